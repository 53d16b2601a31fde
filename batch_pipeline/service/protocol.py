"""What the areas' models share: `Record`, the base of what the store keeps as JSON."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A record the store keeps as a JSON object, parsed once where it is read (`store.py`).

    Fields this version does not know (a newer replica's) are kept as they are and written back. The
    fields in OMITTED are left out of the JSON while None: the service always wrote them only once set,
    and their absence means something to older replicas reading the same store (`open`)."""

    model_config = ConfigDict(extra="allow")
    OMITTED: ClassVar[tuple[str, ...]] = ()

    def stored(self) -> dict[str, Any]:
        """The JSON object written to storage."""
        return self.model_dump(mode="json", exclude={name for name in self.OMITTED if getattr(self, name) is None})

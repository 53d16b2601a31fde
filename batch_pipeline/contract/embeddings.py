"""/v1/embeddings bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from batch_pipeline.contract.common import EMBEDDINGS_URL, LenientModel, check_fields


class EmbeddingBody(LenientModel):
    model: str = Field(min_length=1)
    input: Union[str, Annotated[list[str], Field(min_length=1)]]
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"

    @model_validator(mode="before")
    @classmethod
    def _every_field_honoured_or_refused(cls, data: Any) -> Any:
        check_fields(data, cls, EMBEDDINGS_URL)
        return data

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

"""The Files API's models: OpenAI's FileObject, the record the store keeps of a file, and the answers
of list and delete."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel

from batch_pipeline.service.protocol import Record


class FileObject(BaseModel):
    """OpenAI's FileObject, as every Files route answers it (in this order, `expires_at` null without expiry)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str  # "batch" (an upload) or "batch_output" (a batch's output or error file)
    status: str = "processed"


class FileRecord(Record, FileObject):
    """What the store keeps of a file: its FileObject, whose it is and where its content is; an upload
    deleted (or swept as expired) keeps its record, marked."""

    OMITTED: ClassVar[tuple[str, ...]] = ("deleted", "expired")

    tenant: str
    uri: str  # the content: an upload's copy, or a batch's output.jsonl / errors.jsonl
    deleted: bool | None = None
    expired: bool | None = None

    def public(self) -> FileObject:
        """The FileObject (without where it is stored or whose it is)."""
        return FileObject.model_validate(self.model_dump(include=set(FileObject.model_fields)))


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True

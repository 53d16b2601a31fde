"""The Batches API's models: the record the store keeps of a batch, OpenAI's Batch object as the API
answers it, and a page of the list."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from batch_pipeline.contract import Batch, Usage
from batch_pipeline.service.protocol import Record


class RunFailure(BaseModel):
    """Why the batch's run failed for good, read once from Dagster (`dagster_client.failure_reason`)."""

    run_id: str | None = None
    reason: str = ""
    at: int | None = None


class BatchRecord(Record):
    """What the store keeps of a batch (`_batch_api/batches/<id>.json`): what it was created with, its
    run, and what the service has seen of it since. A record is read whatever fields it has: one from
    before a field existed takes its default."""

    OMITTED: ClassVar[tuple[str, ...]] = ("expires_at", "model_versions", "open", "turn", "submit_error", "cancelling_at",
                                          "terminate_pending", "run_failure")

    id: str
    tenant: str
    input_file_id: str = ""
    input_uri: str = ""
    endpoint: str = ""
    completion_window: str = "24h"
    metadata: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0
    created_at: int
    expires_at: int | None = None  # None in records from before completion windows: created_at + 24 h
    date: str = ""  # the partition (UTC day) its run answers in
    output_uri: str = ""  # where the pipeline writes its results
    run_id: str | None = None  # None until submitted
    output_expires_after: int | None = None  # seconds the results are kept once written
    model_versions: str | None = None  # the versioned models pinned at create ("name=v ...")
    open: bool | None = None  # among its tenant's open batches; None: kept before that index existed
    turn: int | None = None  # its turn in the run queue (dagster_client.turn)
    submit_error: str | None = None  # the run could not be submitted: the batch is failed
    cancelling_at: int | None = None
    terminate_pending: bool | None = None  # cancelled while its run was starting: terminated once started
    run_failure: RunFailure | None = None


class PendingTermination(Record):
    """A marker of a batch whose run awaits its terminate (`_batch_api/terminate_pending/<id>.json`):
    what the sweep reads to find the batch's record."""

    id: str = ""
    tenant: str = ""


class BatchObject(Batch):
    """OpenAI's Batch object as the API answers it: the contract's `Batch` (the object the pipeline
    writes as batch.json), sent with only the fields set (`body`): a batch not written by the
    pipeline yet has no `model`, `usage` or most `*_at`, as OpenAI leaves them out."""

    usage: Usage | None = None  # none until the pipeline wrote the batch
    metadata: dict[str, Any] = Field(default_factory=dict)  # as created: `priority` may be a number

    def body(self) -> dict[str, Any]:
        """The JSON answer: the fields set, nulls where they were set to None."""
        return self.model_dump(mode="json", exclude_unset=True)


class BatchList(BaseModel):
    """A page of `GET /v1/batches`, newest first."""

    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)

"""A line's envelope and the Batch object (docs/CONTRACT.md): `BatchRequest` (custom_id, method,
url, body, with each endpoint's body model in `BODY_MODELS`), the request counts, usage and errors,
and `Batch`, the object OpenAI's Batch API returns."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from batch_pipeline.contract.chat import ChatBody
from batch_pipeline.contract.common import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RERANK_URL, RESPONSES_URL, SCORE_URL
from batch_pipeline.contract.completions import CompletionBody
from batch_pipeline.contract.embeddings import EmbeddingBody
from batch_pipeline.contract.responses import ResponsesBody
from batch_pipeline.contract.scoring import RerankBody, ScoreBody


# OpenAI's Batch statuses (the Batch object's `status`).
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]


BODY_MODELS: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatBody,
    COMPLETIONS_URL: CompletionBody,
    EMBEDDINGS_URL: EmbeddingBody,
    SCORE_URL: ScoreBody,
    RERANK_URL: RerankBody,
    RESPONSES_URL: ResponsesBody,
}

Body = Union[ChatBody, CompletionBody, EmbeddingBody, ScoreBody, RerankBody]


class BatchRequest(BaseModel):
    """One valid input line, as carried from validation to inference."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]
    # The batch the line is of, when one engine stream answers several batches (a run's files
    # planned together, steps/inference.py); empty: the stream's own batch id.
    batch_id: str = ""

    def parsed_body(self) -> Body:
        return BODY_MODELS[self.url].model_validate(self.body)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Batch object
# --------------------------------------------------------------------------------------------


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class BatchFileError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchFileError] = Field(default_factory=list)


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    created_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    expires_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: Usage = Field(default_factory=Usage)
    metadata: dict[str, str] = Field(default_factory=dict)

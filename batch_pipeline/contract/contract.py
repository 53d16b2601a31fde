"""The OpenAI Batch contract (docs/CONTRACT.md): a line's envelope, the Batch object, and every body.

The request bodies live in one module per endpoint family (chat.py, completions.py, embeddings.py,
scoring.py, responses.py; what they share in common.py). Input bodies are validated strictly where
OpenAI is strict (ranges, types, roles) and leniently where it is lenient. Their names are
re-exported here, so a caller imports this one module and reads `contract.ChatBody`,
`contract.CHAT_URL`, `contract.INVALID_REQUEST`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, Field

from batch_pipeline.contract.chat import (  # noqa: F401  re-exported
    FUNCTION_NAME,
    CalledFunction,
    ChatBody,
    ChatMessage,
    ChatTool,
    FunctionDef,
    ImagePart,
    ImageUrl,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolChoice,
    tool_choice_problem,
)
from batch_pipeline.contract.common import (  # noqa: F401  re-exported
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    CHAT_URL,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    COMPLETIONS_URL,
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_CUSTOM_ID,
    EMBEDDINGS_URL,
    IGNORED_FIELDS,
    INVALID_JSON,
    INVALID_METHOD,
    INVALID_REQUEST,
    MAX_CUSTOM_ID_LENGTH,
    MODEL_NOT_FOUND,
    REFUSED_FIELDS,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
    SCORING_URLS,
    SUPPORTED_URLS,
    UNSUPPORTED_URL,
    URL_MISMATCH,
    VLLM_SAMPLING_EXTRAS,
    LenientModel,
    ReasoningEffort,
    SamplingBody,
    StopField,
    StrictModel,
    check_fields,
)
from batch_pipeline.contract.completions import (  # noqa: F401  re-exported
    CompletionBody,
)
from batch_pipeline.contract.embeddings import (  # noqa: F401  re-exported
    EmbeddingBody,
)
from batch_pipeline.contract.responses import (  # noqa: F401  re-exported
    HOSTED_TOOL_CHOICE,
    ResponsesBody,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesImagePart,
    ResponsesInputItem,
    ResponsesMessage,
    ResponsesReasoning,
    ResponsesText,
    ResponsesTextFormat,
    ResponsesTextPart,
    ResponsesTool,
)
from batch_pipeline.contract.scoring import (  # noqa: F401  re-exported
    SCORE_SIDES,
    RerankBody,
    ScoreBody,
    ScoreText,
    ScoreTexts,
)

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

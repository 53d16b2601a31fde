"""The OpenAI Batch contract as pydantic models (docs/CONTRACT.md).

Input request bodies are validated strictly where OpenAI is strict (ranges, types, roles) and
leniently where it is lenient (unknown extra fields are kept and ignored). Output lines, error lines
and the Batch object are modelled so that what we write round-trips through these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
SCORING_URLS = (SCORE_URL, RERANK_URL)
SUPPORTED_URLS = (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    SCORE_URL,
    RERANK_URL,
)

MAX_CUSTOM_ID_LENGTH = 64

# Error codes used in error lines (BATCH_CONTRACT.md, "Error file").
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_URL = "unsupported_url"
INVALID_METHOD = "invalid_method"
MODEL_NOT_FOUND = "model_not_found"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"

BATCH_STATUSES = (
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
)


class _Lenient(BaseModel):
    """Request parts: unknown fields are accepted and ignored, like the online endpoint does."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        # Only an assistant turn that carries tool calls may omit its content.
        if self.content is None and not (self.role == "assistant" and getattr(self, "tool_calls", None)):
            raise ValueError("content is required")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class JsonSchemaSpec(_Lenient):
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


StopField = Union[str, Annotated[list[str], Field(max_length=4)], None]


class _SamplingBody(_Lenient):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's token id (as a string) -> bias from -100 to 100, added to that token's logit.
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's own extension: constrain the output to a regex, a choice, a JSON schema or a grammar.
    structured_outputs: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # Reasoning models: how hard to think (passed to the chat template, which must take it), and
    # vLLM's extension for any other chat template variable (e.g. Qwen3's enable_thinking).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionBody(_SamplingBody):
    prompt: Union[str, Annotated[list[str], Field(min_length=1)]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    response_format: ResponseFormat | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def token_limit(self) -> int | None:
        # OpenAI's legacy completions endpoint defaults to 16 tokens.
        return self.max_tokens if self.max_tokens is not None else 16


class EmbeddingBody(_Lenient):
    model: str = Field(min_length=1)
    input: Union[str, Annotated[list[str], Field(min_length=1)]]
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# /v1/score and /v1/rerank as vLLM's server takes them (its ScoreRequest and RerankRequest).
ScoreText = Annotated[str, Field(min_length=1)]
ScoreTexts = Union[ScoreText, Annotated[list[ScoreText], Field(min_length=1)]]
# vLLM's names for the two sides of a score request, newest first: (first, second).
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))


class ScoreBody(_Lenient):
    """Similarity of each query with each document: 1 -> 1, 1 -> N or N -> N pairs."""

    model: str = Field(min_length=1)
    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None

    @model_validator(mode="after")
    def _two_sides(self) -> "ScoreBody":
        given = [(a, b) for a, b in SCORE_SIDES if getattr(self, a) is not None or getattr(self, b) is not None]
        if not given:
            raise ValueError("queries and documents are required")
        first, second = given[0]
        if getattr(self, first) is None:
            raise ValueError(f"{first}: required with {second}")
        if getattr(self, second) is None:
            raise ValueError(f"{second}: required with {first}")
        left, right = self.pairs_sides()
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"{first}: {len(left)} texts for {len(right)} {second}; give one, or one per {second[:-1] if second.endswith('s') else second}")
        return self

    def sides(self) -> tuple[str, str]:
        return next((a, b) for a, b in SCORE_SIDES if getattr(self, a) is not None)

    def pairs_sides(self) -> tuple[list[str], list[str]]:
        first, second = self.sides()
        a, b = getattr(self, first), getattr(self, second)
        return ([a] if isinstance(a, str) else list(a)), ([b] if isinstance(b, str) else list(b))


class RerankBody(_Lenient):
    """One query, its documents ranked by relevance (Cohere/Jina shape, as vLLM serves it)."""

    model: str = Field(min_length=1)
    query: ScoreText
    documents: ScoreTexts
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    @model_validator(mode="before")
    @classmethod
    def _one_query(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("query"), list):
            raise ValueError("query: one string is ranked against the documents; for several queries use /v1/score")
        return data

    def document_list(self) -> list[str]:
        return [self.documents] if isinstance(self.documents, str) else list(self.documents)


BODY_MODELS: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatBody,
    COMPLETIONS_URL: CompletionBody,
    EMBEDDINGS_URL: EmbeddingBody,
    SCORE_URL: ScoreBody,
    RERANK_URL: RerankBody,
}

Body = Union[ChatBody, CompletionBody, EmbeddingBody, ScoreBody, RerankBody]


class BatchRequest(BaseModel):
    """One valid input line, as carried from validation to inference."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]

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
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
    ]
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

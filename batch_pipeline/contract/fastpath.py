"""A fast accept-only check of input lines, in C (msgspec), for the common case: a valid line.

The rules mirror the body models under contract/. A line this schema accepts is valid; a line it rejects goes to the
pydantic validation in validation.py, which is authoritative and says exactly what is wrong. So
the fast path may be stricter than the contract (then the slow path decides), never more lenient
(test_validation.py checks every invalid case against it). Measured on 100k chat lines: the pydantic
path alone took 3.8x as long as `json.loads` merely parsing them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from batch_pipeline import contract

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Positive = Annotated[int, Meta(ge=1)]
NonEmpty = Annotated[str, Meta(min_length=1)]


class _TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class _CalledFunction(msgspec.Struct):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct):
    id: str
    function: _CalledFunction
    type: Literal["function"] = "function"


class _Message(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[_TextPart], None] = None
    name: Union[str, None] = None
    tool_calls: Union[list[_ToolCall], None] = None
    tool_call_id: Union[str, None] = None

    def __post_init__(self) -> None:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required")


class _JsonSchema(msgspec.Struct):
    name: Annotated[str, Meta(max_length=64)] = "response"
    schema: dict[str, Any] = {}
    strict: Union[bool, None] = None


class _ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Union[_JsonSchema, None] = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required")


class _Function(msgspec.Struct):
    name: Annotated[str, Meta(pattern=contract.FUNCTION_NAME)]
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class _Tool(msgspec.Struct):
    type: Literal["function"]
    function: _Function


class _NamedFunction(msgspec.Struct):
    name: str


class _NamedToolChoice(msgspec.Struct):
    type: Literal["function"]
    function: _NamedFunction


class _Ignored(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields every body may carry that change nothing offline (contract.IGNORED_FIELDS).
    Unknown fields go to the pydantic path, which refuses them or says why they are fine
    (contract.check_fields); `modalities` always takes that path."""

    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    stream_options: Any = None


class _Sampling(_Ignored):
    model: NonEmpty
    temperature: Union[Temperature, None] = None
    top_p: Union[TopP, None] = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    stop: Union[str, Annotated[list[str], Meta(max_length=4)], None] = None
    seed: Union[int, None] = None
    presence_penalty: Union[Penalty, None] = None
    frequency_penalty: Union[Penalty, None] = None
    max_tokens: Union[Positive, None] = None
    logit_bias: Union[dict[int, Annotated[float, Meta(ge=-100, le=100)]], None] = None
    structured_outputs: Union[dict[str, Any], None] = None
    stream: Union[bool, None] = None  # true is refused (the subclasses' __post_init__)
    # contract.VLLM_SAMPLING_EXTRAS (checked by vLLM when the request is built)
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None


class _ChatBody(_Sampling):
    messages: Annotated[list[_Message], Meta(min_length=1)] = []
    max_completion_tokens: Union[Positive, None] = None
    logprobs: bool = False
    top_logprobs: Union[Annotated[int, Meta(ge=0, le=20)], None] = None
    response_format: Union[_ResponseFormat, None] = None
    reasoning_effort: Union[contract.ReasoningEffort, None] = None
    chat_template_kwargs: Union[dict[str, Any], None] = None
    tools: Union[list[_Tool], None] = None
    tool_choice: Union[contract.ToolChoice, _NamedToolChoice, None] = None
    parallel_tool_calls: Union[bool, None] = None

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("messages are required")
        if self.stream:
            raise ValueError("stream")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs")
        fmt = self.response_format is not None and self.response_format.type != "text"
        names = [t.function.name for t in self.tools or []]
        if contract.tool_choice_problem(self.tool_choice, names, fmt, bool(self.structured_outputs)):
            raise ValueError("tool_choice")


class _CompletionBody(_Sampling):
    prompt: Union[str, Annotated[list[str], Meta(min_length=1)], None] = None
    echo: bool = False
    logprobs: Union[Annotated[int, Meta(ge=0, le=5)], None] = None
    response_format: Union[_ResponseFormat, None] = None

    def __post_init__(self) -> None:
        if self.prompt is None:
            raise ValueError("prompt is required")
        if self.stream:
            raise ValueError("stream")


class _EmbeddingBody(_Ignored):
    model: NonEmpty
    input: Union[str, Annotated[list[str], Meta(min_length=1)]]
    dimensions: Union[Positive, None] = None
    encoding_format: Literal["float", "base64"] = "float"


class _Line(msgspec.Struct):
    custom_id: NonEmpty
    method: str


class ChatLine(_Line, tag_field="url", tag=contract.CHAT_URL):
    body: _ChatBody


class CompletionLine(_Line, tag_field="url", tag=contract.COMPLETIONS_URL):
    body: _CompletionBody


class EmbeddingLine(_Line, tag_field="url", tag=contract.EMBEDDINGS_URL):
    body: _EmbeddingBody


FastLine = Union[ChatLine, CompletionLine, EmbeddingLine]
URLS = {ChatLine: contract.CHAT_URL, CompletionLine: contract.COMPLETIONS_URL, EmbeddingLine: contract.EMBEDDINGS_URL}

decoder = msgspec.json.Decoder(FastLine)
ERRORS = (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError)

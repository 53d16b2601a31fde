"""The OpenAI Batch contract as pydantic models (docs/CONTRACT.md).

Input request bodies are validated strictly where OpenAI is strict (ranges, types, roles) and
leniently where it is lenient (unknown extra fields are kept and ignored). Output lines, error lines
and the Batch object are modelled so that what we write round-trips through these models.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
SCORING_URLS = (SCORE_URL, RERANK_URL)
RESPONSES_URL = "/v1/responses"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions endpoint: max_tokens when a line gives none
SUPPORTED_URLS = (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    SCORE_URL,
    RERANK_URL,
    RESPONSES_URL,
)

MAX_CUSTOM_ID_LENGTH = 64

# Error codes used in error lines (BATCH_CONTRACT.md, "Error file").
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_URL = "unsupported_url"
URL_MISMATCH = "url_mismatch"  # a line whose url is not its batch's endpoint (the Batch API's, as OpenAI names it)
INVALID_METHOD = "invalid_method"
MODEL_NOT_FOUND = "model_not_found"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"

# OpenAI's Batch statuses (the Batch object's `status`).
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]


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


# ------------------------------------------------------------------------ tool (function) calling
#
# OpenAI's function tools on chat lines: the tools declared, which of them the model must call
# (tool_choice) and the calls of earlier turns in the history (assistant tool_calls, tool results).

ToolChoice = Literal["none", "auto", "required"]  # or a named function (NamedToolChoice)
# OpenAI's rule for a function's name.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(_Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Lenient):
    type: str
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"{value!r} tools are not supported: only 'function' tools can be called in a batch")
        return value


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Lenient):
    name: str
    arguments: str  # a JSON object, as a string (as OpenAI sends it)


class ToolCall(_Lenient):
    """A call the assistant made in an earlier turn (history)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns: the calls it made
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        # Only an assistant turn that carries tool calls may omit its content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
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
# OpenAI's `reasoning_effort` values (chat) and `reasoning.effort` (Responses).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# ------------------------------------------------------------------ every body field, one fate
#
# A batch that quietly does something other than what a line asked for is worse than one that
# refuses the line. So a chat, completions or embeddings body field is either honoured (a field of
# the body model below, or one of vLLM's extensions), ignored because it changes nothing offline,
# or refused per line naming it, with the reason; a field this pipeline does not know is refused
# too (as OpenAI's own API refuses an unrecognized argument). docs/CONTRACT.md has the table.

# Change nothing in an offline batch: accepted and ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                            "stream_options"})
# vLLM's own sampling extensions (SamplingParams fields), honoured as its server honours them.
VLLM_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                        "bad_words", "allowed_token_ids")
_GUIDED = "vLLM's old guided_* fields are gone: use structured_outputs ({\"regex\": ...}, {\"json\": ...}, ...)"
# Chat declares the tool fields (ChatBody); on other endpoints they could only be ignored.
_TOOLS_CHAT_ONLY = "tools are called on /v1/chat/completions lines only"
# Known, and impossible here: refused, with the reason.
REFUSED_FIELDS = {
    "audio": "audio output cannot be produced: the served models write text",
    "prediction": "predicted outputs are not supported by vLLM's offline engine",
    "web_search_options": "web search runs on OpenAI's servers and cannot run in an offline batch",
    "functions": "the legacy functions API is not supported; declare tools instead",
    "function_call": "the legacy functions API is not supported; use tool_choice instead",
    "verbosity": "the served models have no verbosity setting; say how long to answer in the prompt",
    "tools": _TOOLS_CHAT_ONLY,
    "tool_choice": _TOOLS_CHAT_ONLY,
    "parallel_tool_calls": _TOOLS_CHAT_ONLY,
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "prompt_logprobs": "prompt logprobs have no place in OpenAI's response bodies",
}


@functools.cache
def _declared(model: type[BaseModel]) -> frozenset[str]:
    """A body model's field names and aliases (once per model, not once per line)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def check_fields(data: Any, model: type[BaseModel], endpoint: str, extensions: tuple[str, ...] = ()) -> None:
    """Refuse (ValueError naming the field) a body field that would otherwise be silently ignored."""
    if not isinstance(data, dict):
        return
    known = _declared(model)
    for key, value in data.items():
        if key in known or key in IGNORED_FIELDS or key in extensions:
            continue
        if key == "stream":
            if value not in (None, False):
                raise ValueError("stream: a batch line cannot be streamed: leave stream out or false")
            continue
        if key == "modalities":
            if value not in (None, ["text"]):
                raise ValueError(f"modalities: only [\"text\"] can be produced here (got {json.dumps(value)[:60]})")
            continue
        if key in REFUSED_FIELDS:
            raise ValueError(f"{key}: {REFUSED_FIELDS[key]}")
        raise ValueError(f"{key}: not a field of {endpoint} this pipeline knows; it would be ignored, so the line is "
                         "refused (docs/CONTRACT.md lists every field)")


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

    # Subclasses say which endpoint they are, for the message of a refused field.
    ENDPOINT: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _every_field_honoured_or_refused(cls, data: Any) -> Any:
        check_fields(data, cls, cls.ENDPOINT, VLLM_SAMPLING_EXTRAS)
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatBody(_SamplingBody):
    ENDPOINT: ClassVar[str] = CHAT_URL
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # Reasoning models: how hard to think (passed to the chat template, which must take it), and
    # vLLM's extension for any other chat template variable (e.g. Qwen3's enable_thinking).
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (docs/CONTRACT.md, "Tool calling"). The legacy functions/function_call are not taken.
    tools: list[ChatTool] | None = None
    tool_choice: Union[ToolChoice, NamedToolChoice, None] = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self) -> "ChatBody":
        problem = tool_choice_problem(self.tool_choice, [t.function.name for t in self.tools or []],
                                      self.response_format is not None and self.response_format.type != "text",
                                      bool(self.structured_outputs))
        if problem:
            raise ValueError(f"tool_choice: {problem}")
        return self

    def tool_mode(self) -> str:
        """How the tools are used: none (no tools, or tool_choice none), auto, required or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def tool_choice_problem(choice: Any, names: list[str], response_format: bool, structured_outputs: bool) -> str | None:
    """What is wrong with a chat line's tool_choice given its tools (shared with the fast path)."""
    if choice is None or choice in ("none", "auto"):
        return None
    named = choice if isinstance(choice, str) else choice.function.name
    if not names:
        return f"{named!r} needs tools: give body.tools"
    if not isinstance(choice, str) and named not in names:
        return f"names the function {named!r}, which is not among body.tools ({', '.join(names)})"
    if response_format or structured_outputs:
        other = "response_format" if response_format else "structured_outputs"
        return f"a forced tool call constrains the output to the call's JSON, and so does {other}: give one of them"
    return None


class CompletionBody(_SamplingBody):
    ENDPOINT: ClassVar[str] = COMPLETIONS_URL
    prompt: Union[str, Annotated[list[str], Field(min_length=1)]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    response_format: ResponseFormat | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS


class EmbeddingBody(_Lenient):
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


# ---------------------------------------------------------------------- /v1/responses bodies
#
# OpenAI's Responses API, offline: one Response per line, run as a chat on the served model.
# What only exists on a server that keeps state (stored responses, conversations, background
# runs) or calls out (hosted tools) is refused, naming the field.

HOSTED_TOOL_CHOICE = "only function tools can run in an offline batch"
# Passed through to the chat the line runs as (vLLM's extensions, as on chat lines).
_RESPONSES_TO_CHAT = ("seed", "logit_bias", "structured_outputs", "chat_template_kwargs",
                      "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens")


class ResponsesTextPart(_Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class ResponsesMessage(_Lenient):
    """An input item: a message (`type` may be left out, as OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ResponsesTextPart]]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class ResponsesFunctionCall(_Lenient):
    """An input item: a call the model made earlier in the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class ResponsesFunctionCallOutput(_Lenient):
    """An input item: the result of a call, as the caller ran it."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


def _input_item_kind(value: Any) -> str:
    # Tags with a "-", which error locations leave out (validation._clean_loc): an error in an item
    # names body.input[i].<field>. Other item types are taken for messages, whose `type` then says
    # what is expected.
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return f"item-{kind}" if kind in ("function_call", "function_call_output") else "item-message"


ResponsesInputItem = Annotated[
    Union[
        Annotated[ResponsesMessage, Tag("item-message")],
        Annotated[ResponsesFunctionCall, Tag("item-function_call")],
        Annotated[ResponsesFunctionCallOutput, Tag("item-function_call_output")],
    ],
    Discriminator(_input_item_kind),
]


class ResponsesTextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponsesTextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is 'json_schema'")
        return self

    def as_response_format(self) -> dict[str, Any]:
        """The chat `response_format` that constrains the output the same way."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_, "strict": self.strict}}

    def echo(self) -> dict[str, Any]:
        """As a Response echoes it (`text.format`)."""
        if self.type != "json_schema":
            return {"type": self.type}
        return self.model_dump(by_alias=True, exclude_none=True)


class ResponsesText(_Lenient):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Lenient):
    # `summary` is accepted and ignored: the thinking is given whole, as reasoning_text.
    effort: ReasoningEffort | None = None


class ResponsesTool(_Lenient):
    """A Responses function tool (flat: name, description, parameters, strict at the top)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"{value!r} tools run on OpenAI's servers and cannot run in an offline batch")
        return value

    @model_validator(mode="after")
    def _named(self) -> "ResponsesTool":
        if not self.name:
            raise ValueError("name: a function tool needs a name")
        return self

    def as_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        """As a Response echoes it in `tools`."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters or {}, "strict": self.strict if self.strict is not None else False}


class ResponsesBody(_Lenient):
    model: str = Field(min_length=1)
    input: Union[str, Annotated[list[ResponsesInputItem], Field(min_length=1)]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extensions, as on chat lines.
    seed: int | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored: store, service_tier, include, truncation, parallel_tool_calls, ...
    stream: bool | None = None
    background: bool | None = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("a batch line cannot be streamed: leave stream out or false")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("a batch line already runs in the background: leave background out or false")
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _nothing_stored(cls, value: Any, info: Any) -> Any:
        if value is not None:
            what = {"previous_response_id": "response", "conversation": "conversation", "prompt": "prompt template"}
            raise ValueError(f"a {what[info.field_name]} stored on a server cannot be used in an offline batch: "
                             "give the whole conversation in input")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict) and value.get("type") == "function":
            if not isinstance(value.get("name"), str) or not value["name"]:
                raise ValueError("a function tool_choice names the function: {\"type\": \"function\", \"name\": ...}")
            return value
        kind = value.get("type") if isinstance(value, dict) else value
        raise ValueError(f"{json.dumps(kind)[:40]}: {HOSTED_TOOL_CHOICE} (none, auto, required or "
                         "{\"type\": \"function\", \"name\": ...})")

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> "ResponsesBody":
        names = [t.name for t in self.tools or []]
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice: 'required' needs tools")
        if isinstance(self.tool_choice, dict) and self.tool_choice["name"] not in names:
            raise ValueError(f"tool_choice: {self.tool_choice['name']!r} is not one of the tools"
                             + (f" ({', '.join(map(repr, names))})" if names else " (none given)"))
        return self

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice

    def text_format(self) -> ResponsesTextFormat | None:
        return self.text.format if self.text is not None else None

    def conversation_messages(self) -> list[dict[str, Any]]:
        """The chat the line runs as: the instructions as a system message, then the input; function
        calls become an assistant turn's tool_calls (consecutive calls: one turn), their outputs
        tool messages."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, ResponsesFunctionCall):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, ResponsesFunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                messages.append({"role": item.role, "content": item.text()})
        return messages

    def as_chat(self) -> ChatBody:
        """The chat completions body this line runs as (same sampling, constraint and thinking)."""
        fmt = self.text_format()
        extras = {**(self.model_extra or {}), **self.model_dump(include=set(_RESPONSES_TO_CHAT), exclude_none=True)}
        chat = {
            "model": self.model,
            "messages": self.conversation_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": fmt.as_response_format() if fmt is not None else None,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
            **({"tools": [t.as_chat_tool() for t in self.tools]} if self.tools else {}),
            **({"tool_choice": self.chat_tool_choice()} if self.tool_choice is not None and self.tools else {}),
            **({"parallel_tool_calls": self.parallel_tool_calls} if self.parallel_tool_calls is not None else {}),
            **{k: v for k, v in extras.items() if k in _RESPONSES_TO_CHAT},
        }
        return ChatBody.model_validate(chat)


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

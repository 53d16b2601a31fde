"""/v1/chat/completions bodies: messages, content parts, function tools and tool_choice, response_format."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from batch_pipeline.contract.common import CHAT_URL, LenientModel, ReasoningEffort, SamplingBody, StrictModel


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageUrl(StrictModel):
    # A data: URL (base64), s3:// or an allowed https:// host: io/images.py checks it at validation as far
    # as it can without fetching or decoding (steps/validation.py), then fetches and decodes it in the run.
    url: str = Field(min_length=1)
    # Accepted and ignored: the model's own processor decides the resolution.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(StrictModel):
    """An image in a user message (docs/CONTRACT.md, "Images"); only a model that takes images gets one."""

    type: Literal["image_url"]
    image_url: ImageUrl


def _part_kind(value: Any) -> str:
    # Tags with a "-", which error locations leave out (validation._clean_loc): an error in a part
    # names body.messages[i].content[j].<field>. Any other type is taken for text, whose `type` then
    # says what is expected.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "part-image_url" if kind == "image_url" else "part-text"


ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("part-text")], Annotated[ImagePart, Tag("part-image_url")]],
    Discriminator(_part_kind),
]


# ------------------------------------------------------------------------ tool (function) calling
#
# OpenAI's function tools on chat lines: the tools declared, which of them the model must call
# (tool_choice) and the calls of earlier turns in the history (assistant tool_calls, tool results).

ToolChoice = Literal["none", "auto", "required"]  # or a named function (NamedToolChoice)
# OpenAI's rule for a function's name.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(LenientModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(LenientModel):
    type: str
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"{value!r} tools are not supported: only 'function' tools can be called in a batch")
        return value


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(LenientModel):
    name: str
    arguments: str  # a JSON object, as a string (as OpenAI sends it)


class ToolCall(LenientModel):
    """A call the assistant made in an earlier turn (history)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns: the calls it made
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        # Only an assistant turn that carries tool calls may omit its content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required")
        if self.role != "user" and self.images():
            raise ValueError(f"content: image parts are taken in user messages only, not in a {self.role} message")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def images(self) -> list[ImagePart]:
        return [part for part in self.content if isinstance(part, ImagePart)] if isinstance(self.content, list) else []


class JsonSchemaSpec(LenientModel):
    name: str = Field(default="response", max_length=64)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class ChatBody(SamplingBody):
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

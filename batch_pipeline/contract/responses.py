"""/v1/responses bodies: OpenAI's Responses API, offline: one Response per line, run as a chat on the
served model (`ResponsesBody.as_chat`). What only exists on a server that keeps state (stored
responses, conversations, background runs) or calls out (hosted tools) is refused, naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from batch_pipeline.contract.chat import ChatBody
from batch_pipeline.contract.common import LenientModel, ReasoningEffort

HOSTED_TOOL_CHOICE = "only function tools can run in an offline batch"
# Passed through to the chat the line runs as (vLLM's extensions, as on chat lines).
_RESPONSES_TO_CHAT = ("seed", "logit_bias", "structured_outputs", "chat_template_kwargs",
                      "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens")


class ResponsesTextPart(LenientModel):
    type: Literal["input_text", "output_text"]
    text: str


class ResponsesImagePart(LenientModel):
    """An `input_image` part of a user message: run as the chat's `image_url` part (io/images.py
    fetches it). A `file_id` names a file uploaded to OpenAI's Files API, which an offline batch
    cannot read."""

    type: Literal["input_image"]
    image_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted and ignored, as on chat lines

    @model_validator(mode="after")
    def _url_given(self) -> "ResponsesImagePart":
        if self.image_url is None:
            if self.file_id is not None:
                raise ValueError("file_id: file ids are not supported; give image_url")
            raise ValueError("image_url: an image needs a url (a data: URL, s3:// or https://)")
        return self

    def as_chat_part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.image_url, **({"detail": self.detail} if self.detail else {})}}


def _part_kind(value: Any) -> str:
    # As _input_item_kind: tags with a "-"; any other type is taken for text, which names what is expected.
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "part-input_image" if kind == "input_image" else "part-text"


ResponsesContentPart = Annotated[
    Union[Annotated[ResponsesTextPart, Tag("part-text")], Annotated[ResponsesImagePart, Tag("part-input_image")]],
    Discriminator(_part_kind),
]


class ResponsesMessage(LenientModel):
    """An input item: a message (`type` may be left out, as OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ResponsesContentPart]]

    @model_validator(mode="after")
    def _images_from_the_user(self) -> "ResponsesMessage":
        if self.role != "user" and self.images():
            raise ValueError(f"content: input_image parts are taken in user messages only, not in a {self.role} message")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, ResponsesTextPart))
        return self.content

    def images(self) -> list[ResponsesImagePart]:
        return [p for p in self.content if isinstance(p, ResponsesImagePart)] if isinstance(self.content, list) else []

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content of the chat message it runs as: its text, or with images its parts in order."""
        if not self.images():
            return self.text()
        return [p.as_chat_part() if isinstance(p, ResponsesImagePart) else {"type": "text", "text": p.text}
                for p in self.content]


class ResponsesFunctionCall(LenientModel):
    """An input item: a call the model made earlier in the conversation."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class ResponsesFunctionCallOutput(LenientModel):
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


class ResponsesTextFormat(LenientModel):
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


class ResponsesText(LenientModel):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(LenientModel):
    # `summary` is accepted and ignored: the thinking is given whole, as reasoning_text.
    effort: ReasoningEffort | None = None


class ResponsesTool(LenientModel):
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


class ResponsesBody(LenientModel):
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
                messages.append({"role": item.role, "content": item.chat_content()})
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

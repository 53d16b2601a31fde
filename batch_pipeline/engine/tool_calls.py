"""Tool (function) calling on chat lines: how each `tool_choice` runs, and the calls read back.

- `none` (or no tools): an ordinary answer; the tools still go to the chat template.
- a named function: the output is constrained (structured outputs) to a JSON object matching the
  function's `parameters`, which becomes that function's one call's `arguments`.
- `required`: constrained to a JSON array of `{"name": <one of the tools>, "parameters": ...}`
  (one item when `parallel_tool_calls` is false), as vLLM's own server constrains it.
- `auto` (the default with tools): the model answers freely and vLLM's tool parser for its family
  (TOOL_CALL_PARSER: `hermes`, `llama3_json`, ...) reads any calls out of the text.

Call ids are deterministic (ids.tool_call_id), so a re-run writes the same lines.
"""

from __future__ import annotations

import copy
import json
import types
from dataclasses import dataclass, field
from typing import Any

from batch_pipeline.base import ids
from batch_pipeline.engine import vllm_adapter
from batch_pipeline.config.settings import ConfigError


class ToolParserConfigError(ConfigError):
    """TOOL_CALL_PARSER cannot be used with this model; the message names the variable."""


def parser_names() -> list[str]:
    return vllm_adapter.tool_parser_names()


def _params(parameters: dict[str, Any] | None) -> dict[str, Any]:
    # No parameters still means an arguments object (vLLM's rule too).
    return parameters if parameters else {"type": "object", "properties": {}}


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The JSON schema a named tool_choice constrains the output to: the function's parameters."""
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return _params(function.get("parameters"))


def required_schema(tools: list[dict[str, Any]], parallel: bool | None) -> dict[str, Any]:
    """The JSON schema of tool_choice `required`: a list of calls, each a tool's name and parameters
    (vLLM's server builds the same, `$defs` of the tools' parameters lifted to the top)."""
    items, defs = [], {}
    for tool in tools:
        function = tool["function"]
        params = copy.deepcopy(_params(function.get("parameters")))
        defs.update(params.pop("$defs", None) or {})
        items.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolPlan:
    """How one chat line uses its tools (ChatBody.tool_mode) and what goes to the engine."""

    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]] | None = None  # to the chat template (None: no tools given)
    schema: dict[str, Any] | None = None  # required / named: the structured-output constraint
    name: str | None = None  # named: the function
    sampling: dict[str, Any] = field(default_factory=dict)  # auto: what the parser asks of decoding


def plan(body: Any, parser: "ToolParser | None") -> ToolPlan:
    """The plan for a parsed ChatBody. Raises ValueError for `auto` without TOOL_CALL_PARSER."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    mode = body.tool_mode()
    if mode == "named":
        name = body.tool_choice.function.name
        return ToolPlan(mode, tools, named_schema(tools, name), name)
    if mode == "required":
        return ToolPlan(mode, tools, required_schema(tools, body.parallel_tool_calls))
    if mode == "auto":
        if parser is None:
            raise ValueError(
                "tool_choice: 'auto' (the default when tools are given) needs a tool parser to read the calls from "
                "the model's text, and none is configured: set TOOL_CALL_PARSER to the one of the model's family "
                "(e.g. hermes, llama3_json), or give tool_choice 'required', a named function, or 'none'")
        return ToolPlan(mode, tools, sampling=parser.sampling_for(body))
    return ToolPlan(mode, tools)


@dataclass
class Extracted:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI tool_calls, ids included


def _call(batch_id: str, line: int, choice: int, index: int, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": ids.tool_call_id(batch_id, line, choice, index), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def extract(plan: ToolPlan, parser: "ToolParser | None", body: Any, text: str, batch_id: str, line: int,
            choice: int) -> Extracted | None:
    """The calls in one generated text, or None when it is an ordinary answer (no calls found, or a
    constrained JSON that does not parse: e.g. cut off by the token limit)."""
    if plan.mode == "named":
        try:
            arguments = json.loads(text)
        except ValueError:
            return None
        return Extracted(None, [_call(batch_id, line, choice, 0, plan.name, arguments)])
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            pairs = [(c["name"], c["parameters"]) for c in calls]
        except (ValueError, TypeError, KeyError):
            return None
        return Extracted(None, [_call(batch_id, line, choice, i, n, a) for i, (n, a) in enumerate(pairs)])
    if plan.mode == "auto" and parser is not None:
        found = parser.extract(text, body)
        if found is None:
            return None
        content, pairs = found
        return Extracted(content, [_call(batch_id, line, choice, i, n, a) for i, (n, a) in enumerate(pairs)])
    return None


class ToolParser:
    """One of vLLM's tool parsers (TOOL_CALL_PARSER) on one model's tokenizer, built once per engine."""

    def __init__(self, name: str, tokenizer: Any, model: str = ""):
        self.name = name
        try:
            cls = vllm_adapter.tool_parser_class(name)
        except KeyError:
            raise ToolParserConfigError(
                f"TOOL_CALL_PARSER={name!r} is not one of vLLM's tool parsers; choose one of {', '.join(parser_names())}"
            ) from None
        try:
            self.parser = cls(tokenizer)
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer lacks the parser's special tokens
            raise ToolParserConfigError(
                f"TOOL_CALL_PARSER={name} does not fit the model{f' {model}' if model else ''}: {e} "
                "(is it a tool-calling model of that family?)"
            ) from e

    def request(self, body: Any) -> Any:
        """vLLM's ChatCompletionRequest for the line's tools, as the parser reads them."""
        return vllm_adapter.tool_parser_request([t.model_dump(exclude_none=True) for t in body.tools or []])

    def sampling_for(self, body: Any) -> dict[str, Any]:
        """What the parser asks of decoding for a line with tools (e.g. hermes keeps special tokens,
        as `<tool_call>` is one in some models), as vLLM's server lets it adjust the request."""
        probe = types.SimpleNamespace(tools=body.tools, tool_choice="auto", skip_special_tokens=True,
                                      structured_outputs=None, response_format=None, parallel_tool_calls=None)
        try:
            adjusted = self.parser.adjust_request(probe)
        except Exception:  # noqa: BLE001 - a parser that wants the real request type: nothing to adjust
            return {}
        return {"skip_special_tokens": bool(getattr(adjusted, "skip_special_tokens", True))}

    def extract(self, text: str, body: Any) -> tuple[str | None, list[tuple[str, Any]]] | None:
        info = self.parser.extract_tool_calls(text, self.request(body))
        if not info.tools_called or not info.tool_calls:
            return None
        return info.content or None, [(c.function.name, c.function.arguments) for c in info.tool_calls]

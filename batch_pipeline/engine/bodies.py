"""Response bodies from vLLM's outputs, in OpenAI's shapes: `chat.completion`, `text_completion`,
`response` (/v1/responses) and the embeddings `list`, so the openai SDK's types load them.

Each builder returns the line's `Answer` (contract/lines.py wraps it in the output-line envelope).
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from batch_pipeline.base import ids
from batch_pipeline import contract
from batch_pipeline.contract.lines import Answer, success
from batch_pipeline.engine import tool_calls



def chat_body(batch_id: str, req: contract.BatchRequest, body: Any, out: Any, model: str, created: int,
              reasoning: Any = None, template_kwargs: dict[str, Any] | None = None,
              tools: Any = None, tool_parser: Any = None) -> Answer:
    """A `chat.completion` from one vLLM RequestOutput (n choices). With a reasoning parser
    (engine/reasoning.py), each message's thinking is apart from its content. With tools
    (engine/tool_calls.py), the calls found are `message.tool_calls` and content is null."""
    top = body.top_logprobs or 0
    forced = tools is not None and tools.schema is not None
    choices, reasoning_tokens = [], 0
    for i, comp in enumerate(out.outputs):
        message: dict[str, Any] = {"role": "assistant", "content": comp.text, "refusal": None}
        if reasoning is not None:
            split = reasoning.split(comp.text, comp.token_ids, template_kwargs, constrained=constrained(body) or forced)
            # Both names: reasoning_content (DeepSeek's API, vLLM before 0.11), reasoning (vLLM since).
            message.update(content=split.content, reasoning_content=split.reasoning, reasoning=split.reasoning)
            reasoning_tokens += split.reasoning_tokens
        reason = finish_reason(comp)
        if tools is not None and tools.mode != "none" and reason != "length":
            # A text cut by the token limit is no call: it stays content, finish_reason "length".
            found = tool_calls.extract(tools, tool_parser, body, message["content"], batch_id, req.line, i)
            if found is not None:
                message.update(content=found.content, tool_calls=found.calls)
                # OpenAI: "stop" when the call was forced by name, "tool_calls" when the model chose.
                reason = "stop" if tools.mode == "named" else "tool_calls"
        choices.append({
            "index": i,
            "message": message,
            "logprobs": _chat_logprobs(comp, top) if body.logprobs else None,
            "finish_reason": reason,
        })
    prompt_tokens = len(out.prompt_token_ids or [])
    completion_tokens = sum(len(comp.token_ids) for comp in out.outputs)
    return _completion(batch_id, req, "chat.completion", choices, model, created, prompt_tokens, completion_tokens,
                       reasoning_tokens, cached_tokens(out))


def responses_body(batch_id: str, req: contract.BatchRequest, body: Any, chat: Any, out: Any, params: Any,
                   model: str, created: int, reasoning: Any = None,
                   template_kwargs: dict[str, Any] | None = None, tools: Any = None, tool_parser: Any = None) -> Answer:
    """An OpenAI `response` (/v1/responses) from the RequestOutput of the chat the line ran as
    (`chat`, ResponsesBody.as_chat). With a reasoning parser, the thinking is a `reasoning` item
    before the message; an answer cut by the token limit is `incomplete` (max_output_tokens)."""
    comp = out.outputs[0]
    cut = finish_reason(comp) == "length"
    text, thinking, reasoning_tokens = comp.text, None, 0
    if reasoning is not None:
        split = reasoning.split(comp.text, comp.token_ids, template_kwargs, constrained=constrained(chat))
        text, thinking, reasoning_tokens = split.content, split.reasoning, split.reasoning_tokens
    item_status = "incomplete" if cut else "completed"
    calls: list[dict[str, Any]] = []
    if tools is not None and tools.mode != "none" and not cut:  # the chat's tool calls, as function_call items
        found = tool_calls.extract(tools, tool_parser, chat, text, batch_id, req.line, 0)
        if found is not None:
            text, calls = found.content or "", found.calls
    output: list[dict[str, Any]] = []
    if thinking is not None:
        output.append({
            "type": "reasoning",
            "id": ids.response_item_id("rs", batch_id, req.line),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": thinking}],
            "status": "incomplete" if cut and not text else "completed",
        })
    if text or (not calls and (thinking is None or not cut)):  # cut while thinking: no message, as OpenAI answers
        output.append({
            "type": "message",
            "id": ids.response_item_id("msg", batch_id, req.line),
            "status": item_status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })
    for call in calls:
        output.append({"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    prompt_tokens = len(out.prompt_token_ids or [])
    completion_tokens = len(comp.token_ids)
    cached = cached_tokens(out)
    fmt = body.text_format()
    payload = {
        "id": ids.response_id(batch_id, req.line),
        "object": "response",
        "created_at": created,
        "status": item_status,
        "completed_at": int(time.time()) if not cut else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "background": False,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "text": {"format": fmt.echo() if fmt is not None else {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.echo() for t in body.tools or []],
        "truncation": "disabled",
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "user": body.user,
        "metadata": body.metadata or {},
    }
    return success(batch_id, req, payload, prompt_tokens, completion_tokens, reasoning_tokens, cached)


def completion_body(
    batch_id: str, req: contract.BatchRequest, body: Any, prompts: Sequence[str], outs: Sequence[Any], model: str,
    created: int, decode: Callable[[int], str],
) -> Answer:
    """A `text_completion` from one vLLM RequestOutput per prompt. With `echo` and `logprobs`, the
    logprobs cover the prompt's tokens before the completion's, the first with none (nothing comes
    before it), as OpenAI's legacy endpoint and vLLM's server give them: the run asked vLLM for the
    prompt's logprobs (`prompt_logprobs`); `decode` names the first token."""
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for prompt_text, out in zip(prompts, outs):
        prompt_tokens += len(out.prompt_token_ids or [])
        cached += cached_tokens(out)
        echoed = _prompt_logprobs(out, decode) if body.echo and body.logprobs is not None else []
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            echo = prompt_text if body.echo else ""
            choices.append(
                {
                    "index": len(choices),
                    "text": echo + comp.text,
                    "logprobs": _completion_logprobs(comp, echoed) if body.logprobs is not None else None,
                    "finish_reason": finish_reason(comp),
                }
            )
    return _completion(batch_id, req, "text_completion", choices, model, created, prompt_tokens, completion_tokens,
                       0, cached)


def _completion(
    batch_id: str, req: contract.BatchRequest, kind: str, choices: list[dict[str, Any]], model: str, created: int,
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0, cached: int = 0,
) -> Answer:
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    payload = {
        "id": ids.completion_id(prefix, batch_id, req.line),
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            **usage(prompt_tokens, completion_tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
        },
        "system_fingerprint": None,
    }
    return success(batch_id, req, payload, prompt_tokens, completion_tokens, reasoning_tokens, cached)


def embeddings_body(batch_id: str, req: contract.BatchRequest, body: Any, outs: Sequence[Any], model: str) -> Answer:
    """An embeddings `list` from vLLM's embed outputs (one per input)."""
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.embedding, body.encoding_format)}
        for i, o in enumerate(outs)
    ]
    payload = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return success(batch_id, req, payload, prompt_tokens, 0)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def constrained(body: Any) -> bool:
    """Whether the output was generated under a structured-output constraint."""
    fmt = getattr(body, "response_format", None)
    return bool(getattr(body, "structured_outputs", None)) or (fmt is not None and fmt.type != "text")


def cached_tokens(out: Any) -> int:
    """Prompt tokens vLLM found in its prefix cache (0 when it does not say)."""
    return int(getattr(out, "num_cached_tokens", 0) or 0)


def finish_reason(comp: Any) -> str:
    # vLLM says "stop", "length" or "abort"; the OpenAI types accept stop/length/... only.
    return "length" if comp.finish_reason == "length" else "stop"


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    values = [float(v) for v in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


# ------------------------------------------------------------------------------------- logprobs


def _token_text(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _floor(logprob: float) -> float:
    # -inf is not JSON; OpenAI's own floor for impossible tokens is -9999.0.
    return max(float(logprob), -9999.0)


def _sampled(comp: Any) -> Iterator[tuple[int, dict[int, Any]]]:
    yield from zip(comp.token_ids, comp.logprobs or [])


def _chat_logprobs(comp: Any, top: int) -> dict[str, Any]:
    content = []
    for token_id, candidates in _sampled(comp):
        # vLLM returns the top-k plus the sampled token when it is outside them: keep the top-k.
        ranked = sorted(candidates.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        entry = _logprob_entry(candidates[token_id])
        content.append({**entry, "top_logprobs": [_logprob_entry(lp) for lp in ranked[:top]]})
    return {"content": content, "refusal": None}


def _logprob_entry(lp: Any) -> dict[str, Any]:
    text = _token_text(lp)
    return {"token": text, "logprob": _floor(lp.logprob), "bytes": list(text.encode("utf-8"))}


# One token of a completion's logprobs: its text, its logprob and its top candidates (None for a
# prompt's first token: nothing comes before it).
LogprobEntry = tuple[str, "float | None", "dict[str, float] | None"]


def _legacy_entry(token_id: int, candidates: dict[int, Any]) -> LogprobEntry:
    return (_token_text(candidates[token_id]), _floor(candidates[token_id].logprob),
            {_token_text(lp): _floor(lp.logprob) for lp in candidates.values()})


def _prompt_logprobs(out: Any, decode: Callable[[int], str]) -> list[LogprobEntry]:
    """The prompt's tokens as completion logprobs (vLLM's `prompt_logprobs`: None for the first)."""
    token_ids = list(out.prompt_token_ids or [])
    found = list(out.prompt_logprobs or [])
    found += [None] * (len(token_ids) - len(found))
    return [(decode(token_id), None, None) if candidates is None
            else _legacy_entry(token_id, candidates) for token_id, candidates in zip(token_ids, found)]


def _completion_logprobs(comp: Any, echoed: Sequence[LogprobEntry]) -> dict[str, Any]:
    """OpenAI's legacy logprobs: the echoed prompt's tokens (if any), then the completion's; each
    token's text_offset counts from the choice's text (the prompt included when echoed)."""
    entries = [*echoed, *(_legacy_entry(token_id, candidates) for token_id, candidates in _sampled(comp))]
    offsets, offset = [], 0
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": offsets}

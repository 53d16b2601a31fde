"""The result lines of a batch: the one answer each input line gets, as an output or an error line.

Every line of `output.jsonl` and `errors.jsonl` is wrapped here. An error line is made by
`error_line` alone, whatever refused the request: validation (`InvalidLine`), the engine's checks
before running it (`contract_error`), cancellation (`cancelled_line`), expiry (`expired_line`).
The bodies inside output lines are built from vLLM's outputs in engine/bodies.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batch_pipeline.base import ids
from batch_pipeline import contract


@dataclass
class Answer:
    """The single answer to one request: an output line or an error line."""

    line: int
    kind: str  # "output" | "error"
    record: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, the thinking (REASONING_PARSER)
    cached_tokens: int = 0  # of prompt_tokens, the ones found in vLLM's prefix cache
    rank: int = 0  # the data-parallel rank that computed it (ranks.py); 0 with one engine
    batch_id: str = ""  # the batch whose line it answers (a stream may answer several: BatchRequest.batch_id)


def error_line(batch_id: str, line: int, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An errors.jsonl line for a request that never reached the model: `{"response": null, "error"}`."""
    return {
        "id": ids.request_line_id(batch_id, line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }


def contract_error(batch_id: str, req: contract.BatchRequest, code: str, message: str) -> Answer:
    """A request refused before it ran (e.g. a prompt longer than the context)."""
    return Answer(req.line, "error", error_line(batch_id, req.line, req.custom_id, code, f"line {req.line}: {message}"),
                  batch_id=batch_id)


def cancelled_line(batch_id: str, line: int, custom_id: str) -> dict[str, Any]:
    message = f"line {line}: the batch was cancelled before this request ran"
    return error_line(batch_id, line, custom_id, contract.BATCH_CANCELLED, message)


def expired_line(batch_id: str, line: int, custom_id: str) -> dict[str, Any]:
    message = f"line {line}: the batch's completion window ended before this request ran"
    return error_line(batch_id, line, custom_id, contract.BATCH_EXPIRED, message)


def engine_error(batch_id: str, req: contract.BatchRequest, exc: BaseException, status: int = 400) -> Answer:
    """vLLM refused the request: an error response in OpenAI's shape, as its server would send."""
    message = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": None,
        }
    }
    return Answer(req.line, "error", _envelope(batch_id, req, status, body), batch_id=batch_id)


def success(batch_id: str, req: contract.BatchRequest, body: dict[str, Any], prompt: int, completion: int,
            reasoning: int = 0, cached: int = 0) -> Answer:
    return Answer(req.line, "output", _envelope(batch_id, req, 200, body), prompt, completion, reasoning, cached,
                  batch_id=batch_id)


def _envelope(batch_id: str, req: contract.BatchRequest, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": ids.request_line_id(batch_id, req.line),
        "custom_id": req.custom_id,
        "response": {"status_code": status, "request_id": ids.request_id(batch_id, req.line), "body": body},
        "error": None,
    }

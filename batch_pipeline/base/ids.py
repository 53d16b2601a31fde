"""Deterministic identifiers, so that re-running a batch writes the same ids for the same lines."""

from __future__ import annotations

import hashlib


def _digest(*parts: object, size: int = 12) -> str:
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(str(part).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def batch_id(seed: str) -> str:
    return "batch_" + _digest("batch", seed)


def request_line_id(batch_id: str, line: int) -> str:
    return "batch_req_" + _digest("line", batch_id, line)


def request_id(batch_id: str, line: int) -> str:
    return "req_" + _digest("request", batch_id, line)


def completion_id(prefix: str, batch_id: str, line: int) -> str:
    return f"{prefix}-" + _digest("completion", batch_id, line)


def response_id(batch_id: str, line: int) -> str:
    """A /v1/responses Response's id."""
    return "resp_" + _digest("response", batch_id, line)


def response_item_id(prefix: str, batch_id: str, line: int) -> str:
    """The id of an output item of a Response (`msg`, `rs`)."""
    return f"{prefix}_" + _digest("item", prefix, batch_id, line)


def tool_call_id(batch_id: str, line: int, choice: int, index: int) -> str:
    """The id of the `index`th tool call in choice `choice` of a chat answer."""
    return "call_" + _digest("tool_call", batch_id, line, choice, index)

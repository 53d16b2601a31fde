"""What a request's prompt is as far as its place in an order goes: its text, and hashes of its prefixes.

Two orders use them. A run's plan (steps/ordering.py) walks the prefix tree these hashes describe,
so that the requests sharing a system prompt or a document are fed next to each other. A run on a
warm engine also gives each request a rank from them (`prefix_rank`) inside its vLLM priority
(engine/remote.py), so that the server's waiting queue puts the users of one prefix together across
every run it serves: the same prefix gets the same rank in every run, whoever planned it.

The text is the chat template's rendering when a renderer is given (the model's tokenizer, loaded by
the plan when it can be), else the request's own text in the order templates lay it out: tools, then
each message. It is cut at LEVELS characters, about 1, 4, 16, 64, 256 and 1024 KV blocks of 16
tokens at ~4 characters a token, and each cut hashed (CRC-32 of the prefix, chained).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from batch_pipeline import contract

# Cut points of the rendered prompt, in characters (bytes of its UTF-8).
LEVELS = (64, 256, 1024, 4096, 16384, 65536)
# prefix_rank: the first RANK_LEVELS cuts, RANK_BITS of each cut's hash (a 24-bit rank).
RANK_LEVELS = 4
RANK_BITS = 6
RANK_SPAN = 1 << (RANK_LEVELS * RANK_BITS)

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content, sort_keys=True)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": str(m.get("role", "")), "content": _text(m.get("content"))}
            for m in body.get("messages") or [] if isinstance(m, dict)]


def prompt_text(url: str, body: dict[str, Any], render: Render | None = None) -> str:
    """The prompt of a request as the engine will see it, as far as the plan needs it: the chat
    template's rendering when `render` is given and accepts it, else the request's own text in the
    order templates lay it out (tools, then each message)."""
    if url == contract.CHAT_URL:
        messages = chat_messages(body)
        tools = body.get("tools") or None
        if render is not None:
            try:
                return render(messages, tools)
            except Exception:  # noqa: BLE001 - a line the template refuses still gets a key
                pass
        head = json.dumps(tools, sort_keys=True) if tools else ""
        return head + "".join(f"\x1e{m['role']}\x1f{m['content']}" for m in messages)
    if url == contract.RESPONSES_URL:
        given = body.get("input")
        turns = given if isinstance(given, str) else "".join(
            f"\x1e{i.get('role', '')}\x1f{_text(i.get('content'))}" for i in given or [] if isinstance(i, dict))
        return f"{body.get('instructions') or ''}{turns}"
    if url == contract.COMPLETIONS_URL:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    return json.dumps([body.get(k) for k in ("input", "query", "queries", "documents", "text_1", "text_2")])


def prefix_hashes(text: str) -> list[int]:
    """CRC-32 of the text's prefix at each of LEVELS (of the whole text where it is shorter)."""
    data = text.encode("utf-8", "surrogatepass")
    hashes, crc, done = [], 0, 0
    for cut in LEVELS:
        end = min(cut, len(data))
        crc = zlib.crc32(data[done:end], crc)
        done = end
        hashes.append(crc)
    return hashes


def prefix_rank(url: str, body: dict[str, Any]) -> int:
    """A rank in [0, RANK_SPAN) of a request's prompt prefix, the same in every run: RANK_BITS of its
    hash at each of the first RANK_LEVELS cuts, the outermost cut in the leading bits. Requests that
    share a prefix up to a cut share the rank's bits down to that cut, so sorted by rank the users of
    a prefix are contiguous (unless two prefixes' bits collide at every level above, about one in
    2^(RANK_BITS x levels)), and prefixes come in the same order everywhere."""
    rank = 0
    for crc in prefix_hashes(prompt_text(url, body))[:RANK_LEVELS]:
        rank = (rank << RANK_BITS) | (crc >> (32 - RANK_BITS))
    return rank


@runtime_checkable
class SharesPrefix(Protocol):
    """A stream of requests that also says, for the one it returned last, how many LEVELS of prompt
    prefix that one shares with the one before it (`shared`; 0 for the first). A run's plan gives
    one (steps/ordering.py PlannedStream); a data-parallel feeder cuts its chunks where `shared` is
    least (engine/ranks.py), so that a prefix's users go to one rank."""

    shared: int

    def __iter__(self) -> Iterator[Any]: ...

    def __next__(self) -> Any: ...

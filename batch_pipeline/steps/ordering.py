"""The order in which a run feeds a batch's valid requests to the engine (ORDER=planned).

A batch file is known in full before its first request is answered, so unlike an online server the
pipeline can choose the order. Two things pay:

- **Shared prefixes together.** vLLM's prefix cache keeps the KV blocks of a prompt's prefix while
  requests that use it are running or recently ran. Requests that share a system prompt, a document
  or a few-shot block, fed next to each other, compute that prefix once; scattered through the
  file, the prefix is evicted between its users and computed again (the issue's 30 documents x 8
  questions, shuffled: 24% of prompt tokens cached in file order, 66% grouped, 1.75x faster).
- **Long decodes first.** A batch whose longest generations start last ends on a tail of a few
  sequences decoding alone, with the device mostly idle; started first, they overlap the rest.

The plan is a depth-first walk of a prefix tree, built from a few bytes of key per request: the
rendered prompt (after the chat template, when the model has one: steps/chat_template.py; else the
request's own text in template order: tools, then each message) is cut at LEVELS characters, about
1, 4, 16, 64, 256 and 1024 KV blocks of 16 tokens at ~4 characters a token, and each cut hashed
(CRC-32 of the prefix; contract/prompts.py). Requests whose prefixes hash alike at a level are one group there; at each
level the groups go in the order of the longest decode they hold (descending), so a subtree
is contiguous in the plan (its prefix stays cached until its last user is scheduled) and long
decodes lead within it. A request's expected decode is what its line says: `max_tokens` (or
`max_completion_tokens`, `max_output_tokens`) times `n`, or the context when it names no limit.

One plan may cover several batches (a run's files, which often share system prompts): each keyed
request also records which batch it is of, and the walk above runs over all of them together.

Memory: KEY_BYTES per request (hashes, decode) plus the positions' file offsets and batch, in a
temporary file instead of memory past PLAN_MEMORY_BYTES (np.memmap); sorting adds ~24 bytes a
request for its duration. Prompts themselves are never held: each request is read, keyed and
dropped. The records are then read back in plan order by offset, from the work file itself when it
is local, else from a local copy made during the same pass (random reads from S3 would cost a
request each).

Nothing a user sees depends on the order: answers are checkpointed by line and the results are
written in input order (results.py), and greedy answers are the same whatever their neighbours.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from batch_pipeline import contract
from batch_pipeline.contract.prompts import LEVELS, Render, prefix_hashes, prompt_text
from batch_pipeline.steps import chat_template

# A request's key; its index in the keys array is its position among the requests keyed.
KEY_DTYPE = np.dtype([("hash", np.uint32, (len(LEVELS),)), ("decode", np.uint32)])
KEY_BYTES = KEY_DTYPE.itemsize
# Keys of more requests than fit in this go to a temporary file (np.memmap) instead of memory.
PLAN_MEMORY_BYTES = 64 * 2**20
# A request that names no output limit may decode up to the context: rank it as this long.
UNBOUNDED_DECODE = 2**20
MAX_DECODE = np.uint64(2**31 - 1)  # decodes are capped here for the sort key
KEY_CHUNK = 8192  # keys are gathered in lists this long, then stored in one numpy assignment
POOLING_URLS = (contract.EMBEDDINGS_URL, *contract.SCORING_URLS)


# -- keys ---------------------------------------------------------------------------------------


def expected_decode(url: str, body: dict[str, Any]) -> int:
    """Output tokens a request may take, from its line: its limit times `n` (0 for pooling)."""
    if url in POOLING_URLS:
        return 0
    if url == contract.COMPLETIONS_URL:
        limit = body.get("max_tokens")
        limit = contract.COMPLETIONS_DEFAULT_MAX_TOKENS if limit is None else limit
    elif url == contract.RESPONSES_URL:
        limit = body.get("max_output_tokens")
    else:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
    try:
        count = max(int(body.get("n") or 1), 1)
        tokens = UNBOUNDED_DECODE if limit is None else max(int(limit), 0)
    except (TypeError, ValueError):
        return UNBOUNDED_DECODE
    return min(tokens * count, int(MAX_DECODE))


# -- the plan -----------------------------------------------------------------------------------


def planned_order(keys: np.ndarray) -> np.ndarray:
    """Indexes into `keys` in plan order: a depth-first walk of the prefix tree where, at each
    level, the subtrees holding the longest decode go first (ties in hash order), then within the
    deepest group each request by its own decode (descending) and its place in the file.

    As a sort: by (-max decode of the level-0 group, level-0 group, -max decode of the level-1
    group, level-1 group, ..., -decode), done as stable sorts from the least significant key up.
    A group's id makes it contiguous even where another group has the same maximum."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    hashes = keys["hash"]
    levels = hashes.shape[1]
    # Requests with equal prefixes (hashes at every level up to k) are contiguous in `order`.
    order = np.lexsort([hashes[:, level] for level in reversed(range(levels))])
    decode = np.minimum(keys["decode"][order], MAX_DECODE).astype(np.uint64)
    final = np.argsort(MAX_DECODE - decode, kind="stable")  # longest first; ties keep hash order
    for level in reversed(range(levels)):
        starts = np.zeros(n, dtype=bool)
        starts[0] = True
        for upper in range(level + 1):
            column = hashes[order, upper]
            starts[1:] |= column[1:] != column[:-1]
        group = np.cumsum(starts, dtype=np.uint64) - 1  # group id at this level, in hash order
        first = np.flatnonzero(starts)
        longest = np.maximum.reduceat(decode, first)[group]
        key = ((MAX_DECODE - longest) << np.uint64(32)) | group
        del starts, group, longest
        final = final[np.argsort(key[final], kind="stable")]
    return order[final]


def shared_levels(hashes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """For each request in `order`, the number of leading LEVELS whose hash equals the previous
    request's (0 for the first): 0 where a new first-block prefix starts, len(LEVELS) for the same
    prompt prefix all the way."""
    n = len(order)
    shared = np.zeros(n, dtype=np.uint8)
    if n < 2:
        return shared
    still = np.ones(n - 1, dtype=bool)
    for level in range(hashes.shape[1]):
        column = hashes[order, level]
        still &= column[1:] == column[:-1]
        shared[1:] += still
    return shared


class PlannedStream:
    """An iterator of planned requests that also says, for the one last returned, how many LEVELS
    of prompt prefix it shares with the one before it (`shared`; a contract.prompts.SharesPrefix): a
    data-parallel feeder cuts its chunks where that is least (engine/ranks.py), so a prefix's users
    go to one rank."""

    def __init__(self, requests: Iterator[Any], shared: Iterator[int]):
        self._requests, self._shared = requests, shared
        self.shared = 0

    def __iter__(self) -> "PlannedStream":
        return self

    def __next__(self) -> Any:
        request = next(self._requests)
        self.shared = next(self._shared, 0)
        return request


@dataclass(frozen=True)
class PlanPart:
    """The requests of one batch (or shard) to plan: `count` records as (byte offset in
    `local_source`, raw requests.jsonl record). `local_source` None: the file is not local (S3),
    and the records are copied to a local temporary file as they are keyed."""

    records: Iterable[tuple[int, bytes]]
    count: int
    local_source: str | None


@dataclass
class Plan:
    """The requests left to answer of one or more batches (or shards), and the order to feed them in."""

    sources: list[str]  # per batch, the file its records are read from (its work file, or a local copy)
    offsets: np.ndarray  # byte offset of each keyed request's record in its batch's source
    parts: np.ndarray  # the batch (index into `sources`) of each keyed request
    order: np.ndarray  # positions into `offsets`, in the order to feed them
    seconds: float = 0.0
    keyed_on: str = ""
    groups: tuple[int, ...] = ()  # prefix groups at each of LEVELS (the plan's subtrees per level)
    spilled: bool = False  # the keys went to a temporary file
    # For each request in plan order, how many LEVELS of prefix it shares with the one before it
    # (0 for the first): where a data-parallel feeder may cut the stream at least cost.
    shared: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
    _cleanup: list[Callable[[], None]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.order)

    def describe_groups(self) -> str:
        """E.g. "prefix groups at 64/256/1024/4096/16384/65536 characters: 1/1/30/240/240/240"."""
        return (f"prefix groups at {'/'.join(str(c) for c in LEVELS)} characters: "
                f"{'/'.join(str(g) for g in self.groups)}")

    def entries(self) -> Iterator[tuple[int, bytes]]:
        """(batch, raw record) in plan order."""
        files: dict[str, BinaryIO] = {}
        try:
            for position in self.order:
                part = int(self.parts[position])
                path = self.sources[part]
                f = files.get(path)
                if f is None:
                    f = files[path] = open(path, "rb")  # noqa: SIM115 - closed below
                f.seek(int(self.offsets[position]))
                yield part, f.readline()
        finally:
            for f in files.values():
                f.close()

    def records(self) -> Iterator[bytes]:
        """The raw records in plan order."""
        return (raw for _, raw in self.entries())

    def stream(self, parse: Callable[[bytes, int], Any]) -> "PlannedStream":
        """The requests in plan order, each parsed by `parse(raw record, batch)`, with each one's
        shared prefix depth alongside."""
        return PlannedStream((parse(raw, part) for part, raw in self.entries()),
                             iter(self.shared.tolist() if len(self.shared) else ()))

    def close(self) -> None:
        while self._cleanup:
            self._cleanup.pop()()


def make_plan(
    records: Iterable[tuple[int, bytes]],
    count: int,
    local_source: str | None,
    render: Render | None = None,
    keyed_on: str = "request text",
    memory_bytes: int = PLAN_MEMORY_BYTES,
    temp_dir: str | None = None,
) -> Plan:
    """Key `count` records (offset in their file, raw JSON of a requests.jsonl record) and plan
    their order. `local_source`: the file the offsets point into, or None to copy each record to a
    local temporary file as it is keyed (a work file on S3)."""
    return make_joint_plan([PlanPart(records, count, local_source)], render, keyed_on, memory_bytes, temp_dir)


def make_joint_plan(
    parts: Sequence[PlanPart],
    render: Render | None = None,
    keyed_on: str = "request text",
    memory_bytes: int = PLAN_MEMORY_BYTES,
    temp_dir: str | None = None,
) -> Plan:
    """Key the records of every part (batch) and plan their order together: requests of different
    batches that share a prefix go to the engine together."""
    started = time.perf_counter()
    if len(parts) > 2**16:
        raise ValueError(f"{len(parts)} batches in one plan; at most {2**16}")
    count = sum(part.count for part in parts)
    tmp = tempfile.TemporaryDirectory(prefix="batch-plan-", dir=temp_dir)
    cleanup = [tmp.cleanup]
    spilled = count * (KEY_BYTES + 8 + 2) > memory_bytes
    if spilled:
        def array(name: str, dtype: Any) -> np.ndarray:
            return np.memmap(Path(tmp.name) / name, dtype=dtype, mode="w+", shape=(max(count, 1),))[:count]

        keys, offsets, batch = array("keys", KEY_DTYPE), array("offsets", np.int64), array("parts", np.uint16)
    else:
        keys, offsets, batch = np.zeros(count, dtype=KEY_DTYPE), np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.uint16)
    copy: BinaryIO | None = None
    copy_path = str(Path(tmp.name) / "requests.jsonl")
    sources: list[str] = []
    n = 0
    chunk: tuple[list[list[int]], list[int], list[int]] = ([], [], [])  # hashes, decodes, offsets

    def flush() -> None:
        hashes, decodes, where = chunk
        if hashes:
            start = n - len(hashes)
            keys["hash"][start:n] = hashes
            keys["decode"][start:n] = decodes
            offsets[start:n] = where
            for column in chunk:
                column.clear()

    try:
        for index, part in enumerate(parts):
            if part.local_source is None and copy is None:
                copy = open(copy_path, "wb")  # noqa: SIM115 - closed below
            sources.append(part.local_source if part.local_source is not None else copy_path)
            first, limit = n, n + part.count
            for offset, raw in part.records:
                if n >= limit:
                    raise ValueError(f"more requests than the {part.count} expected")
                request = json.loads(raw)["request"]
                url, body = request.get("url", ""), request.get("body") or {}
                if part.local_source is None:
                    assert copy is not None
                    offset = copy.tell()
                    copy.write(raw if raw.endswith(b"\n") else raw + b"\n")
                chunk[0].append(prefix_hashes(prompt_text(url, body, render)))
                chunk[1].append(expected_decode(url, body))
                chunk[2].append(offset)
                n += 1
                if len(chunk[0]) >= KEY_CHUNK:
                    flush()
            flush()
            batch[first:n] = index
    finally:
        if copy is not None:
            copy.close()
    keys, offsets, batch = keys[:n], offsets[:n], batch[:n]
    order = planned_order(keys)
    shared = shared_levels(keys["hash"], order)
    # A group starts wherever a request shares fewer levels than that with the one before it.
    groups = tuple(int(np.count_nonzero(shared <= level)) if n else 0 for level in range(len(LEVELS)))
    plan = Plan(sources=sources, offsets=offsets, parts=batch, order=order.astype(np.int64),
                seconds=time.perf_counter() - started, keyed_on=keyed_on, groups=groups, spilled=spilled,
                shared=shared, _cleanup=cleanup)
    del keys
    return plan


@functools.lru_cache(maxsize=4)  # a run's batches, and a test session's runs, load each tokenizer once
def chat_template_renderer(model_path: str) -> tuple[Render | None, str]:
    """The model's chat template as a renderer for the plan's keys, and what the keys are cut from
    (said in the run's log). The template is rendered with jinja2 alone when it can be
    (steps/chat_template.py: no transformers import, seconds of a warm run), else through the
    tokenizer. None when the tokenizer cannot be loaded or has no template: the request's own text
    then keys the plan (the same groups for templates that lay messages out in order, as chat
    templates do)."""
    name = os.path.basename(model_path.rstrip("/")) or model_path
    light = chat_template.renderer(model_path)
    if light is not None:
        return light, f"the chat template of {name}"
    try:
        from batch_pipeline.base.runtime import gc_paused

        with gc_paused():  # as vLLM's own import (runtime.gc_paused): transformers is most of this load
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path)
        if not getattr(tokenizer, "chat_template", None):
            return None, "request text (the model's tokenizer has no chat template)"
    except Exception as e:  # noqa: BLE001 - the plan still works from the request text
        return None, f"request text (the model's tokenizer did not load: {str(e).splitlines()[0][:120]})"

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    return render, f"the chat template of {name}"

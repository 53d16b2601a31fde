"""Line-range shards: one batch answered by several runs at once, on several servers.

`SHARDS=4` (or the launchpad's `shard: "2/4"`, or `batch-pipeline run --shard 2/4`) splits a
batch's valid requests into 4 contiguous, nearly equal ranges, in input order. Each shard is a run
of its own: on Kubernetes a pod of its own with its own GPUs, queued for a slot of the `gpu` pool
like any run, retried alone when it fails. All shards checkpoint into the batch's one answers
folder (part names are unique per writer), each records `_work/inference-shard-<i>-of-<n>.json`,
and the shard that completes last merges those records into `_work/inference.json`; the output
step of whichever shard run finds every shard done writes the one set of result files (the same
files whichever it is: writing them twice is harmless).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from batch_pipeline.io import storage
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.config.settings import ConfigError

_SHARD = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    index: int = 1  # 1-based, as users write it: "2/4"
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 1 <= self.index <= self.count:
            raise ConfigError(f"shard {self.index}/{self.count} does not exist: use i/n with 1 <= i <= n")

    @classmethod
    def parse(cls, text: str | None, name: str = "shard") -> "Shard":
        """"" or None: the whole batch; otherwise "i/n" (ConfigError naming `name` when malformed)."""
        if not text or not text.strip():
            return cls()
        match = _SHARD.fullmatch(text)
        if not match:
            raise ConfigError(f"{name}={text!r} is not a shard: write i/n, e.g. 2/4 for the second of four")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def whole(self) -> bool:
        return self.count == 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def positions(self, valid: int) -> range:
        """The ordinal positions (0-based, among the batch's valid requests in input order) of this shard."""
        start = (self.index - 1) * valid // self.count
        stop = self.index * valid // self.count
        return range(start, stop)

    def record_name(self) -> str:
        return "inference.json" if self.whole else f"inference-shard-{self.index}-of-{self.count}.json"


def shard_records(loc: BatchLocation, count: int) -> list[dict[str, Any] | None]:
    """Each shard's inference record, None where that shard has not written one."""
    records: list[dict[str, Any] | None] = []
    for index in range(1, count + 1):
        uri = loc.work(Shard(index, count).record_name())
        records.append(storage.read_json(uri) if storage.exists(uri) else None)
    return records


def unfinished_shards(records: list[dict[str, Any] | None], key: str | None = None) -> list[int]:
    """The shards (numbered from 1) whose record is missing or not finished (with `key`: or made
    for another checkpoint key, i.e. other input or another model)."""
    return [i for i, r in enumerate(records, 1)
            if not (r and r.get("finished_at") and (key is None or r.get("checkpoint_key") == key))]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of time intervals: shards that ran side by side count once, shards that
    ran one after another add up."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One inference record for the batch from its shards' (all finished, same checkpoint key)."""
    first = records[0]
    width = max(len(r.get("requests_per_rank", [])) for r in records)
    per_rank = [sum(r.get("requests_per_rank", [])[i] if i < len(r.get("requests_per_rank", [])) else 0 for r in records)
                for i in range(width)]
    intervals = [(r["inference_started_at"], r["inference_finished_at"]) for r in records if r.get("inference_started_at")]
    return {
        "checkpoint_key": first["checkpoint_key"],
        "engine": first["engine"],
        "shards": len(records),
        "resumed_requests": sum(r["resumed_requests"] for r in records),
        "computed_requests": sum(r.get("computed_requests", 0) for r in records),
        "in_progress_at": min(r["in_progress_at"] for r in records),
        "finished_at": max(r["finished_at"] for r in records),
        # Loading happens on every shard's server, side by side: the slowest one's.
        "model_load_seconds": max(r.get("model_load_seconds", 0.0) for r in records),
        # Answering: the time at least one shard was answering (see busy_seconds).
        "inference_seconds": round(busy_seconds(intervals), 3) if intervals
        else max(r.get("inference_seconds", 0.0) for r in records),
        "data_parallel_size": max(r.get("data_parallel_size", 1) for r in records),
        "requests_per_rank": per_rank,
        "checkpoint_parts": sum(r.get("checkpoint_parts", 0) for r in records),
        "checkpoint_write_seconds": round(sum(r.get("checkpoint_write_seconds", 0.0) for r in records), 3),
        "peak_memory_mb": max(r.get("peak_memory_mb", 0.0) for r in records),
        "gpu": first.get("gpu", {}),
        "ordering": first.get("ordering", "input"),
        # Each shard plans its own requests, on its own server, side by side: the slowest one's.
        "planning_seconds": max(r.get("planning_seconds", 0.0) for r in records),
    }


def merge_if_complete(loc: BatchLocation, key: str, count: int, write: bool = True) -> tuple[int, dict[str, Any] | None]:
    """(shards finished with this checkpoint key, their merged record once all `count` are, else
    None). With `write`, the merged record is written to inference.json."""
    records = shard_records(loc, count)
    unfinished = unfinished_shards(records, key)
    if unfinished:
        return count - len(unfinished), None
    merged = merge_records([r for r in records if r])
    if write:
        storage.write_json(loc.work("inference.json"), merged)
    return count, merged


def reusable_validation(loc: BatchLocation) -> dict[str, Any] | None:
    """The batch's validation record when it describes the input file as it is now (same ETag),
    else None. Shards of a batch start side by side: the first validates, the others reuse it
    instead of rewriting the same files under a shard that is already answering."""
    uri = loc.work("validation.json")
    if not (storage.exists(uri) and storage.exists(loc.work("requests.jsonl")) and storage.exists(loc.work("invalid.jsonl"))):
        return None
    info = storage.read_json(uri)
    return info if info.get("input_etag") == storage.describe(loc.input_uri).etag else None

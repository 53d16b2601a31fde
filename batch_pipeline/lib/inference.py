"""The inference step of a batch: answer every valid request not answered yet, checkpointing as it goes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

from batch_pipeline.lib import storage
from batch_pipeline.lib.checkpoints import Checkpoint, LineSet, answered_lines, answers_folder, checkpoint_key, record_line
from batch_pipeline.lib.engines import Engines
from batch_pipeline.lib.ranks import RankedEngines
from batch_pipeline.lib.shards import Shard, merge_if_complete
from batch_pipeline.lib.gpu import GpuSampler
from batch_pipeline.lib.locations import BatchLocation
from batch_pipeline.lib.metrics import peak_memory_mb
from batch_pipeline.lib.ordering import Plan, chat_template_renderer, make_plan
from batch_pipeline.lib.progress import Log, Progress, quiet
from batch_pipeline.lib.settings import DEFAULT_ORDER
from batch_pipeline.lib.validation import request_from_record



def _requests_of(loc: BatchLocation, positions: range | None) -> Iterator[tuple[int, bytes]]:
    """(input line, raw record) of the valid requests, in input order; with `positions`, only those
    at these ordinal positions (a shard)."""
    for line, _, raw in _records_of(loc, positions):
        yield line, raw


def _records_of(loc: BatchLocation, positions: range | None) -> Iterator[tuple[int, int, bytes]]:
    """(input line, byte offset, raw record) of the valid requests, in input order; with
    `positions`, only those at these ordinal positions (a shard). The line number is read off the
    record's start (`{"line":N,...}`, as ingest writes it), so skipping other shards' requests
    parses nothing."""
    with storage.open_read(loc.work("requests.jsonl")) as f:
        position, offset = -1, 0
        for raw in f:
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            position += 1
            if positions is not None and position not in positions:
                continue
            yield record_line(raw), at, raw


def plan_requests(loc: BatchLocation, positions: range | None, done: LineSet, count: int, model_path: str,
                  log: Log = quiet, label: str = "") -> Plan:
    """ORDER=planned: the `count` requests not answered yet, keyed and put in plan order
    (lib/ordering.py), before any engine is built. Keys come from the served model's chat template."""
    started = time.perf_counter()
    render, keyed_on = chat_template_renderer(model_path) if model_path else (None, "request text")
    local = storage.local_path(loc.work("requests.jsonl"))
    records = ((offset, raw) for line, offset, raw in _records_of(loc, positions) if line not in done)
    plan = make_plan(records, count, str(local) if local is not None else None, render, keyed_on)
    plan.seconds = time.perf_counter() - started  # the tokenizer's load included
    log(f"{label or loc.name}: planned the order of {len(plan)} requests in {plan.seconds:.2f}s "
        f"({plan.describe_groups()}; keyed on {plan.keyed_on})")
    return plan


def infer_batch(
    loc: BatchLocation,
    engines: Engines | RankedEngines,
    identity: dict[str, Any],
    checkpoint_answers: int,
    checkpoint_seconds: float,
    log: Log = quiet,
    shard: Shard = Shard(),
    deadline: float | None = None,
    order: str = DEFAULT_ORDER,
) -> dict[str, Any]:
    """Answer the requests in _work/requests.jsonl (of `shard` only, when given) that no earlier
    attempt answered; returns what the shard's record (_work/inference.json for a whole batch)
    holds: engine identity, timings, checkpoint parts, peak memory.

    When every request is answered already, no engine is built and the record is left as the
    attempt that did the work wrote it, so its figures survive a run that had nothing to do. The
    shard that completes a sharded batch merges the shards' records into inference.json.

    With a `deadline` (Unix time; the Batch API's completion window), answering stops once it has
    passed: the record gets `expired_at` instead of `finished_at`, and the results step reports the
    requests still unanswered as batch_expired (their answers so far are kept, in the checkpoints).

    `order`: "input" feeds the requests in file order; "planned" (ORDER's default) in the order
    lib/ordering.py plans (shared prefixes together, long decodes first). Which one changes only
    the speed: answers are checkpointed by line and the results written in input order.
    """
    validation = storage.read_json(loc.work("validation.json"))
    key = checkpoint_key(validation["sha256"], identity)
    done = answered_lines(loc, key)
    record = loc.work(shard.record_name())
    positions = None if shard.whole else shard.positions(validation["valid"])
    total = validation["valid"] if positions is None else len(positions)
    answered = done.count if positions is None else sum(1 for line, _ in _requests_of(loc, positions) if line in done)
    label = loc.name if shard.whole else f"{loc.name} shard {shard}"
    previous = storage.read_json(record) if storage.exists(record) else None
    if answered == total and previous and previous.get("checkpoint_key") == key and previous.get("finished_at"):
        log(f"{label}: all {answered} requests already answered; nothing to compute")
        _merge_shards(loc, key, shard, log)
        return {**previous, "computed_requests": 0}
    info: dict[str, Any] = {
        "checkpoint_key": key,
        "engine": identity,
        "resumed_requests": answered,
        "in_progress_at": int(time.time()),
        "finished_at": None,
    }
    if not shard.whole:
        info["shard"] = str(shard)
    if deadline is not None:
        info["expires_at"] = int(deadline)
        if time.time() >= deadline:  # e.g. queued past its window: no model is loaded for it
            info["expired_at"] = int(time.time())
            storage.write_json(record, info)
            log(f"{label}: its deadline passed before it ran; {total - answered} of {total} requests expire")
            return {**info, "computed_requests": 0}
    storage.write_json(record, info)
    if answered:
        log(f"{label}: {answered} of {total} requests already answered; resuming")
    plan: Plan | None = None
    if order == "planned" and total - answered > 1:
        plan = plan_requests(loc, positions, done, total - answered, str(identity.get("model_path") or ""), log, label)
        remaining: Iterator[Any] = plan.stream(lambda raw: request_from_record(json.loads(raw)))
    else:
        remaining = (request_from_record(json.loads(raw)) for line, raw in _requests_of(loc, positions) if line not in done)
    progress = Progress(total, answered, log, label)
    load_before = engines.load_seconds
    ranks = engines.data_parallel_size
    per_rank = [0] * ranks
    clock = getattr(engines, "clock", None)  # None with ranks: each rank's engine is in its own process
    clock_before = dataclasses.replace(clock) if clock is not None else None
    started, started_at = time.monotonic(), time.time()
    expired = False
    with Checkpoint(answers_folder(loc, key), checkpoint_answers, checkpoint_seconds) as checkpoint, GpuSampler() as gpu, \
            (contextlib.closing(plan) if plan is not None else contextlib.nullcontext()):
        stream = engines.stream(validation["batch_id"], remaining, created=int(time.time()), expected=total - answered)
        for answer in stream:
            if not done.add(answer.line):
                raise RuntimeError(f"{label}: line {answer.line} answered twice")
            checkpoint.add(answer)
            per_rank[answer.rank] += 1
            answered += 1
            progress.excluded = engines.load_seconds - load_before
            progress.advance(answer.completion_tokens)
            if deadline is not None and answered < total and time.time() >= deadline:
                expired = True
                stream.close()  # the engine drops the requests still running
                break
    if expired:
        log(f"{label}: its deadline passed; {answered} of {total} requests answered, {total - answered} expire")
    elif answered != total:
        raise RuntimeError(f"{label}: {total} valid requests but {answered} answers")
    load_seconds = engines.load_seconds - load_before
    idle = clock.idle_share(clock_before) if clock is not None else None
    if idle is not None:
        log(f"{label}: the engine stepped {100 * (1 - idle):.1f}% of the answering time (idle {100 * idle:.1f}%: "
            "waiting on this process to prepare requests and take answers)")
    now = int(time.time())
    info.update(
        **({"expired_at": now} if expired else {"finished_at": now}),
        computed_requests=answered - info["resumed_requests"],
        model_load_seconds=round(load_seconds, 3),
        inference_seconds=round(max(time.monotonic() - started - load_seconds, 0.0), 3),
        # Wall-clock span of the answering (after the model load), for merging shards that ran
        # side by side on other servers (shards.busy_seconds).
        inference_started_at=round(started_at + load_seconds, 3),
        inference_finished_at=round(time.time(), 3),
        ordering=order,
        planning_seconds=round(plan.seconds, 3) if plan is not None else 0.0,
        **({"engine_idle_share": idle} if idle is not None else {}),
        data_parallel_size=ranks,
        requests_per_rank=per_rank,
        checkpoint_parts=checkpoint.parts,
        checkpoint_write_seconds=round(checkpoint.write_seconds, 3),
        # With ranks, their processes hold the engines: the run process's peak plus each rank's.
        peak_memory_mb=round(peak_memory_mb() + sum(engines.rank_peak_memory_mb), 1),
        gpu=gpu.figures(),
    )
    storage.write_json(record, info)
    _merge_shards(loc, key, shard, log)
    return info


def _merge_shards(loc: BatchLocation, key: str, shard: Shard, log: Log) -> None:
    if shard.whole:
        return
    finished, merged = merge_if_complete(loc, key, shard.count)
    if merged is None:
        log(f"{loc.name}: shard {shard} done; {finished} of {shard.count} shards finished, the last one writes the results")
    else:
        log(f"{loc.name}: all {shard.count} shards finished")

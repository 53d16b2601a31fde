"""The inference step of a batch: answer every valid request not answered yet, checkpointing as it goes."""

from __future__ import annotations

import time
from typing import Any

from batch_pipeline.lib import storage
from batch_pipeline.lib.checkpoints import Checkpoint, answered_lines, answers_folder, checkpoint_key
from batch_pipeline.lib.engines import Engines
from batch_pipeline.lib.ranks import RankedEngines
from batch_pipeline.lib.gpu import GpuSampler
from batch_pipeline.lib.locations import BatchLocation
from batch_pipeline.lib.metrics import peak_memory_mb
from batch_pipeline.lib.progress import Log, Progress, quiet
from batch_pipeline.lib.validation import request_from_record


def infer_batch(
    loc: BatchLocation,
    engines: Engines | RankedEngines,
    identity: dict[str, Any],
    checkpoint_answers: int,
    checkpoint_seconds: float,
    log: Log = quiet,
) -> dict[str, Any]:
    """Answer the requests in _work/requests.jsonl that no earlier attempt answered; returns what
    _work/inference.json records (engine identity, timings, checkpoint parts, peak memory).

    When every request is answered already, no engine is built and inference.json is left as the
    attempt that did the work wrote it, so its figures survive a run that had nothing to do.
    """
    validation = storage.read_json(loc.work("validation.json"))
    key = checkpoint_key(validation["sha256"], identity)
    done = answered_lines(loc, key)
    previous = storage.read_json(loc.work("inference.json")) if storage.exists(loc.work("inference.json")) else None
    if done.count == validation["valid"] and previous and previous.get("checkpoint_key") == key and previous.get("finished_at"):
        log(f"{loc.name}: all {done.count} requests already answered; nothing to compute")
        return {**previous, "computed_requests": 0}
    info: dict[str, Any] = {
        "checkpoint_key": key,
        "engine": identity,
        "resumed_requests": done.count,
        "in_progress_at": int(time.time()),
        "finished_at": None,
    }
    storage.write_json(loc.work("inference.json"), info)
    if done.count:
        log(f"{loc.name}: {done.count} of {validation['valid']} requests already answered; resuming")
    remaining = (
        request_from_record(r) for r in storage.iter_jsonl(loc.work("requests.jsonl")) if r["line"] not in done
    )
    progress = Progress(validation["valid"], done.count, log, loc.name)
    load_before = engines.load_seconds
    ranks = getattr(engines, "data_parallel_size", 1)
    per_rank = [0] * ranks
    started = time.monotonic()
    with Checkpoint(answers_folder(loc, key), checkpoint_answers, checkpoint_seconds) as checkpoint, GpuSampler() as gpu:
        for answer in engines.stream(validation["batch_id"], remaining, created=int(time.time())):
            if not done.add(answer.line):
                raise RuntimeError(f"{loc.name}: line {answer.line} answered twice")
            checkpoint.add(answer)
            per_rank[answer.rank] += 1
            progress.excluded = engines.load_seconds - load_before
            progress.advance(answer.completion_tokens)
    if done.count != validation["valid"]:
        raise RuntimeError(f"{loc.name}: {validation['valid']} valid requests but {done.count} answers")
    load_seconds = engines.load_seconds - load_before
    info.update(
        finished_at=int(time.time()),
        computed_requests=done.count - info["resumed_requests"],
        model_load_seconds=round(load_seconds, 3),
        inference_seconds=round(max(time.monotonic() - started - load_seconds, 0.0), 3),
        data_parallel_size=ranks,
        requests_per_rank=per_rank,
        checkpoint_parts=checkpoint.parts,
        checkpoint_write_seconds=round(checkpoint.write_seconds, 3),
        # With ranks, their processes hold the engines: the run process's peak plus each rank's.
        peak_memory_mb=round(peak_memory_mb() + sum(getattr(engines, "rank_peak_memory_mb", [])), 1),
        gpu=gpu.figures(),
    )
    storage.write_json(loc.work("inference.json"), info)
    return info

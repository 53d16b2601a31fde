"""The batch lifecycle without Dagster: locate, validate, infer with checkpoints, finalize, measure.

Each step reads and writes files under the batch's output folder, so any step can be re-run on its
own (a Dagster re-execution, the CLI again) and finds what the step before it left:

    <output>/output.jsonl  errors.jsonl  batch.json  metrics.json      the results (the contract)
    <output>/_work/requests.jsonl   valid requests, in input order
    <output>/_work/invalid.jsonl    lines that failed validation
    <output>/_work/validation.json  counts, checksum, batch id, timings
    <output>/_work/answers/<fingerprint>/part-*.jsonl   finished answers, each part written atomically
    <output>/_work/inference.json   engine identity and timings
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import json
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from batch_pipeline.lib import contract as c
from batch_pipeline.lib import ids, storage
from batch_pipeline.lib.engine import Answer, Engines
from batch_pipeline.lib.gpu import GpuSampler
from batch_pipeline.lib.validation import InvalidLine, ValidationSettings, ValidLine, request_from_record, validate_stream

INPUT_SUFFIXES = (".jsonl", ".json", ".ndjson")
Log = Callable[[str], None]


def _quiet(_message: str) -> None:
    return None


@dataclass(frozen=True)
class BatchLocation:
    """Where one batch file comes from and where its results go."""

    name: str
    input_uri: str
    output_uri: str
    partition: str

    def out(self, *parts: str) -> str:
        return storage.join(self.output_uri, *parts)

    def work(self, *parts: str) -> str:
        return storage.join(self.output_uri, "_work", *parts)


def batch_name(input_uri: str) -> str:
    name = storage.basename(input_uri)
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def upload_date(info: storage.ObjectInfo) -> str:
    """The UTC date an object was uploaded (last modified): the partition of an undated batch file."""
    return dt.datetime.fromtimestamp(info.modified, tz=dt.timezone.utc).date().isoformat()


def partition_inputs(input_root: str, partition: str) -> list[storage.ObjectInfo]:
    """Batch files of one date: everything under `<root>/<date>/`, plus files directly under the
    root that were uploaded on that date (UTC)."""
    dated = storage.list_objects(storage.join(input_root, partition), recursive=False)
    undated = [o for o in storage.list_objects(input_root, recursive=False) if upload_date(o) == partition]
    return [o for o in dated + undated if o.uri.endswith(INPUT_SUFFIXES)]


def resolve_batches(input_uri: str, output_uri: str, input_root: str, output_root: str, partition: str) -> list[BatchLocation]:
    """The batches of one run.

    With an explicit input file: that file, into `output_uri` (default
    `<output_root>/<partition>/<batch name>/`). With an explicit folder/prefix: every batch file
    directly in it. With neither: the partition's files (`partition_inputs`). Each folder batch goes
    to `<output_uri or output_root/partition>/<batch name>/`.
    """
    if input_uri and input_uri.endswith(INPUT_SUFFIXES) and storage.exists(input_uri):
        name = batch_name(input_uri)
        target = output_uri or storage.join(output_root, partition, name)
        return [BatchLocation(name=name, input_uri=input_uri, output_uri=target, partition=partition)]
    if input_uri:
        found = [o for o in storage.list_objects(input_uri, recursive=False) if o.uri.endswith(INPUT_SUFFIXES)]
        if not found and not storage.list_objects(input_uri):
            raise FileNotFoundError(f"no batch file or folder at {input_uri}")
    else:
        found = partition_inputs(input_root, partition)
    base = output_uri or storage.join(output_root, partition)
    locations = [
        BatchLocation(name=batch_name(o.uri), input_uri=o.uri, output_uri=storage.join(base, batch_name(o.uri)), partition=partition)
        for o in found
    ]
    claimed: dict[str, str] = {}
    for loc in locations:
        if loc.output_uri in claimed:
            # a.jsonl and a.json (or a dated and an undated a.jsonl) would overwrite each other's results.
            raise ValueError(f"{claimed[loc.output_uri]} and {loc.input_uri} would both write to {loc.output_uri}: rename one")
        claimed[loc.output_uri] = loc.input_uri
    return locations


def is_completed_elsewhere(loc: BatchLocation, run_id: str) -> bool:
    """True when an earlier run completed this batch from the same input object (same ETag)."""
    batch_uri = loc.out("batch.json")
    if not storage.exists(batch_uri):
        return False
    batch = read_json(batch_uri)
    metadata = batch.get("metadata") or {}
    return (
        batch.get("status") == "completed"
        and metadata.get("dagster_run_id") != run_id
        and metadata.get("input_etag") == storage.describe(loc.input_uri).etag
    )


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def _write_json(uri: str, obj: Any) -> None:
    storage.write_bytes(uri, (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))


def read_json(uri: str) -> Any:
    return json.loads(storage.read_text(uri))


def _iter_jsonl(uri: str) -> Iterator[dict[str, Any]]:
    with storage.open_read(uri) as f:
        for raw in f:
            if raw.strip():
                yield json.loads(raw)


def now() -> int:
    return int(time.time())


def peak_memory_mb() -> float:
    # ru_maxrss is in KiB on Linux: the process-wide peak, engine included.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def validate_batch(loc: BatchLocation, settings: ValidationSettings, log: Log = _quiet) -> dict[str, Any]:
    """Stream the input once: valid requests to _work/requests.jsonl, bad lines to _work/invalid.jsonl."""
    created_at = now()
    started = time.perf_counter()
    with storage.open_read(loc.input_uri) as src, storage.open_write(loc.work("requests.jsonl")) as valid_out, storage.open_write(
        loc.work("invalid.jsonl")
    ) as invalid_out:

        def on_valid(valid: ValidLine) -> None:
            valid_out.write(valid.record())

        def on_invalid(bad: InvalidLine) -> None:
            invalid_out.write(_dumps(asdict(bad)))
            log(f"{loc.name}: {bad.code} at line {bad.line}")

        summary = validate_stream(src, settings, on_valid, on_invalid)
    file_error = summary.file_error()
    info = {
        "batch_id": ids.batch_id(f"{loc.input_uri}\0{summary.sha256}\0{loc.partition}"),
        "name": loc.name,
        "input_uri": loc.input_uri,
        "input_etag": storage.describe(loc.input_uri).etag,
        "output_uri": loc.output_uri,
        "partition": loc.partition,
        "sha256": summary.sha256,
        "bytes": summary.bytes_read,
        "lines": summary.lines,
        "valid": summary.valid,
        "invalid": summary.invalid,
        "errors_by_code": dict(summary.errors_by_code),
        "endpoint": summary.endpoint,
        "model": summary.models.most_common(1)[0][0] if summary.models else None,
        "file_error": file_error.model_dump() if file_error else None,
        "created_at": created_at,
        "seconds": round(time.perf_counter() - started, 4),
    }
    _write_json(loc.work("validation.json"), info)
    return info


def first_n_logger(log: Log, limit: int) -> Log:
    """Log the first `limit` messages and then say that the rest are in the error file."""
    count = 0

    def limited(message: str) -> None:
        nonlocal count
        count += 1
        if count <= limit:
            log(message)
        elif count == limit + 1:
            log(f"more than {limit} invalid lines; the rest are listed in errors.jsonl only")

    return limited


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


CHECKPOINT_SECONDS = 30.0
PROGRESS_SECONDS = 10.0


class LineSet:
    """Input line numbers as a bitmap: 1M lines cost 125 KB, not the ~40 MB of a set of ints."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self.count = 0

    def add(self, line: int) -> bool:
        """Add a line; False when it was already there."""
        byte, bit = divmod(line, 8)
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits) + 1024))
        if self._bits[byte] & (1 << bit):
            return False
        self._bits[byte] |= 1 << bit
        self.count += 1
        return True

    def __contains__(self, line: int) -> bool:
        byte, bit = divmod(line, 8)
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << bit))


def checkpoint_fingerprint(validation: dict[str, Any], identity: dict[str, Any]) -> str:
    """What the answers depend on: a checkpoint made for other input or another model is never reused."""
    payload = json.dumps({"sha256": validation["sha256"], "engine": identity}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _answer_parts(loc: BatchLocation, fingerprint: str) -> Iterator[dict[str, Any]]:
    for obj in storage.list_objects(loc.work("answers", fingerprint), recursive=False):
        yield from _iter_jsonl(obj.uri)


class Checkpoint:
    """Finished answers, written in parts: each part a complete object written atomically (a
    temporary name then a rename locally, one PUT on S3), so a kill at any moment loses at most
    the answers of the part being buffered, never corrupts one."""

    def __init__(self, directory: str, every: int, seconds: float = CHECKPOINT_SECONDS):
        self.directory, self.every, self.seconds = directory, every, seconds
        self._tag = f"{time.time_ns():x}-{os.getpid()}"
        self._buffer: list[bytes] = []
        self._last = time.monotonic()
        self.parts = 0

    def add(self, answer: Answer) -> None:
        self._buffer.append(_dumps(asdict(answer)))
        if len(self._buffer) >= self.every or time.monotonic() - self._last >= self.seconds:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            name = f"part-{self._tag}-{self.parts:06d}.jsonl"
            storage.write_bytes(storage.join(self.directory, name), b"".join(self._buffer))
            self.parts += 1
            self._buffer.clear()
        self._last = time.monotonic()


class Progress:
    """Rate and ETA for long work, logged at a steady cadence."""

    def __init__(self, total: int, done: int, log: Log, label: str, every: float = PROGRESS_SECONDS):
        self.total, self.log, self.label, self.every = total, log, label, every
        self.resumed = self.done = done
        self.output_tokens = 0
        self.started = self._last = time.monotonic()
        self.excluded = 0.0  # model loading, kept out of the rate

    def advance(self, answer: Answer) -> None:
        self.done += 1
        self.output_tokens += answer.completion_tokens
        if self.done == self.resumed + 1:
            self._last = time.monotonic()  # the cadence starts with the first answer, not the model load
        if time.monotonic() - self._last >= self.every or self.done == self.total:
            self.report()

    def report(self) -> None:
        self._last = time.monotonic()
        elapsed = max(self._last - self.started - self.excluded, 1e-9)
        rate = (self.done - self.resumed) / elapsed
        eta = f"{(self.total - self.done) / rate:.0f}s" if rate > 0 else "unknown"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        resumed = f", {self.resumed} resumed from checkpoints" if self.resumed else ""
        self.log(
            f"{self.label}: {self.done}/{self.total} requests ({pct:.0f}%), {rate:.2f} req/s, "
            f"{self.output_tokens / elapsed:.1f} output tok/s, ETA {eta}{resumed}"
        )


def answered(loc: BatchLocation, fingerprint: str) -> LineSet:
    lines = LineSet()
    for answer in _answer_parts(loc, fingerprint):
        lines.add(answer["line"])
    return lines


def infer_batch(
    loc: BatchLocation, engines: Engines, identity: dict[str, Any], checkpoint_every: int, log: Log = _quiet
) -> dict[str, Any]:
    """Answer every valid request not answered by an earlier attempt, checkpointing as it goes."""
    validation = read_json(loc.work("validation.json"))
    fingerprint = checkpoint_fingerprint(validation, identity)
    done = answered(loc, fingerprint)
    info: dict[str, Any] = {
        "fingerprint": fingerprint,
        "engine": identity,
        "resumed_requests": done.count,
        "in_progress_at": now(),
        "finished_at": None,
    }
    _write_json(loc.work("inference.json"), info)
    if done.count:
        log(f"{loc.name}: {done.count} of {validation['valid']} requests already answered; resuming")
    remaining = (request_from_record(r) for r in _iter_jsonl(loc.work("requests.jsonl")) if r["line"] not in done)
    progress = Progress(validation["valid"], done.count, log, loc.name)
    checkpoint = Checkpoint(loc.work("answers", fingerprint), checkpoint_every)
    load_before = engines.load_seconds
    started = time.monotonic()
    try:
        with GpuSampler() as gpu:
            for answer in engines.stream(validation["batch_id"], remaining, created=now()):
                if not done.add(answer.line):
                    raise RuntimeError(f"{loc.name}: line {answer.line} answered twice")
                checkpoint.add(answer)
                progress.excluded = engines.load_seconds - load_before
                progress.advance(answer)
    finally:
        checkpoint.flush()  # keep every finished answer, also when cancelled or failing
    if done.count != validation["valid"]:
        raise RuntimeError(f"{loc.name}: {validation['valid']} valid requests but {done.count} answers")
    load_seconds = engines.load_seconds - load_before
    info.update(
        finished_at=now(),
        model_load_seconds=round(load_seconds, 3),
        inference_seconds=round(max(time.monotonic() - started - load_seconds, 0.0), 3),
        checkpoint_parts=checkpoint.parts,
        gpu=gpu.figures(),
    )
    _write_json(loc.work("inference.json"), info)
    return info


# --------------------------------------------------------------------------------------------
# Finalizing: the three contract files
# --------------------------------------------------------------------------------------------


def _cancelled_line(batch_seed: str, record: dict[str, Any]) -> dict[str, Any]:
    line = record["line"]
    return {
        "id": ids.request_line_id(batch_seed, line),
        "custom_id": record["request"]["custom_id"],
        "response": None,
        "error": {"code": c.BATCH_CANCELLED, "message": f"line {line}: the batch was cancelled before this request ran", "line": line},
    }


def finalize_batch(loc: BatchLocation, extra_metadata: dict[str, str] | None = None, cancelled: bool = False) -> dict[str, Any]:
    """Write output.jsonl, errors.jsonl and batch.json from the validation and checkpoint files.

    Every input line is written exactly once: an answer that a concurrent or repeated attempt also
    wrote is skipped. When `cancelled`, requests without an answer are reported as batch_cancelled
    (the next run of the batch computes them and rewrites these files).
    """
    started = time.perf_counter()
    validation = read_json(loc.work("validation.json"))
    batch_seed = validation["batch_id"]
    inference = read_json(loc.work("inference.json")) if validation["valid"] and storage.exists(loc.work("inference.json")) else None
    counts = {"output": 0, "error": 0, "input_tokens": 0, "output_tokens": 0}
    seen = LineSet()
    with storage.open_write(loc.out("output.jsonl")) as out, storage.open_write(loc.out("errors.jsonl")) as err:
        for bad in _iter_jsonl(loc.work("invalid.jsonl")):
            seen.add(bad["line"])
            err.write(_dumps(InvalidLine(**bad).to_error_line(batch_seed)))
            counts["error"] += 1
        for answer in _answer_parts(loc, inference["fingerprint"]) if inference else ():
            if not seen.add(answer["line"]):
                continue
            (out if answer["kind"] == "output" else err).write(_dumps(answer["record"]))
            counts[answer["kind"]] += 1
            counts["input_tokens"] += answer.get("prompt_tokens", 0)
            counts["output_tokens"] += answer.get("completion_tokens", 0)
        if cancelled:
            for req in _iter_jsonl(loc.work("requests.jsonl")):
                if seen.add(req["line"]):
                    err.write(_dumps(_cancelled_line(batch_seed, req)))
                    counts["error"] += 1
        if counts["output"] + counts["error"] != validation["lines"]:
            # Raised inside the writers: nothing is published, the old files (if any) stay.
            raise RuntimeError(
                f"{loc.name}: {validation['lines']} lines in, but {counts['output']} answers + "
                f"{counts['error']} errors: inference has not finished (run inference_results first)"
            )
    finished = now()
    file_error = validation["file_error"]
    status = "failed" if file_error else "cancelled" if cancelled else "completed"
    batch = c.Batch(
        id=batch_seed,
        endpoint=validation["endpoint"],
        model=validation["model"],
        input_file_id=loc.input_uri,
        status=status,
        output_file_id=loc.out("output.jsonl"),
        error_file_id=loc.out("errors.jsonl"),
        errors=c.BatchErrors(data=[c.BatchFileError(**file_error)]) if file_error else None,
        created_at=validation["created_at"],
        in_progress_at=inference["in_progress_at"] if inference else None,
        finalizing_at=(inference or {}).get("finished_at") or finished,
        completed_at=finished if status == "completed" else None,
        failed_at=finished if status == "failed" else None,
        cancelling_at=finished if status == "cancelled" else None,
        cancelled_at=finished if status == "cancelled" else None,
        expires_at=validation["created_at"] + 24 * 3600,
        request_counts=c.RequestCounts(total=validation["lines"], completed=counts["output"], failed=counts["error"]),
        usage=c.Usage(
            input_tokens=counts["input_tokens"],
            output_tokens=counts["output_tokens"],
            total_tokens=counts["input_tokens"] + counts["output_tokens"],
        ),
        metadata={
            "partition": loc.partition,
            "input_sha256": validation["sha256"],
            "input_etag": validation.get("input_etag", ""),
            **({k: str(v) for k, v in inference["engine"].items()} if inference else {}),
            **(extra_metadata or {}),
        },
    )
    _write_json(loc.out("batch.json"), batch.model_dump(mode="json"))
    _write_json(loc.work("finalize.json"), {"seconds": round(time.perf_counter() - started, 4)})
    return batch.model_dump(mode="json")


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def batch_metrics(loc: BatchLocation) -> dict[str, Any]:
    """Throughput figures of one batch, written to metrics.json."""
    batch = read_json(loc.out("batch.json"))
    validation = read_json(loc.work("validation.json"))
    inference = read_json(loc.work("inference.json")) if validation["valid"] else {}
    finalize = read_json(loc.work("finalize.json"))
    infer_s = float(inference.get("inference_seconds", 0.0))
    counts, usage = batch["request_counts"], batch["usage"]

    def per_second(value: float) -> float:
        return round(value / infer_s, 3) if infer_s > 0 else 0.0

    metrics = {
        "batch_id": batch["id"],
        "status": batch["status"],
        "requests_total": counts["total"],
        "requests_completed": counts["completed"],
        "requests_failed": counts["failed"],
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "total_tokens": usage["total_tokens"],
        "model_load_seconds": float(inference.get("model_load_seconds", 0.0)),
        "validation_seconds": float(validation["seconds"]),
        "inference_seconds": infer_s,
        "writing_seconds": float(finalize["seconds"]),
        "requests_per_second": per_second(counts["completed"]),
        "input_tokens_per_second": per_second(usage["input_tokens"]),
        "output_tokens_per_second": per_second(usage["output_tokens"]),
        "total_tokens_per_second": per_second(usage["total_tokens"]),
        "peak_memory_mb": peak_memory_mb(),
        "resumed_requests": int(inference.get("resumed_requests", 0)),
        **inference.get("gpu", {}),
        **{k: v for k, v in inference.get("engine", {}).items()},
    }
    _write_json(loc.out("metrics.json"), metrics)
    return metrics


_SUMMED = (
    "requests_total", "requests_completed", "requests_failed", "input_tokens", "output_tokens", "total_tokens",
    "model_load_seconds", "validation_seconds", "inference_seconds", "writing_seconds",
)


def aggregate_metrics(per_batch: list[dict[str, Any]]) -> dict[str, Any]:
    """One set of figures for a run over several batches (what the Dagster UI plots per partition)."""
    totals: dict[str, Any] = {key: sum(m[key] for m in per_batch) for key in _SUMMED}
    seconds = totals["inference_seconds"]
    for key, numerator in (
        ("requests_per_second", "requests_completed"),
        ("input_tokens_per_second", "input_tokens"),
        ("output_tokens_per_second", "output_tokens"),
        ("total_tokens_per_second", "total_tokens"),
    ):
        totals[key] = round(totals[numerator] / seconds, 3) if seconds > 0 else 0.0
    totals["batches"] = len(per_batch)
    gpu_util = [m["gpu_utilization_mean_pct"] for m in per_batch if "gpu_utilization_mean_pct" in m]
    if gpu_util:
        totals["gpu_utilization_mean_pct"] = round(sum(gpu_util) / len(gpu_util), 1)
        totals["gpu_memory_peak_mb"] = max(m["gpu_memory_peak_mb"] for m in per_batch if "gpu_memory_peak_mb" in m)
    totals["peak_memory_mb"] = max((m["peak_memory_mb"] for m in per_batch), default=peak_memory_mb())
    for key in ("served_model_name", "engine", "model_path", "model_revision"):
        values = sorted({str(m[key]) for m in per_batch if key in m})
        if values:
            totals[key] = ", ".join(values)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in totals.items()}

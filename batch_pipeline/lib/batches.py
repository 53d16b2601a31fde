"""The batch lifecycle without Dagster: locate, validate, infer in shards, finalize, measure.

Each step reads and writes files under the batch's output folder, so any step can be re-run on its
own (a Dagster re-execution, the CLI again) and finds what the step before it left:

    <output>/output.jsonl  errors.jsonl  batch.json  metrics.json      the results (the contract)
    <output>/_work/requests.jsonl   valid requests, in input order
    <output>/_work/invalid.jsonl    lines that failed validation
    <output>/_work/validation.json  counts, checksum, batch id, timings
    <output>/_work/shards/<fingerprint>/shard-NNNNN.jsonl   one answer per request, written atomically
    <output>/_work/inference.json   engine identity and timings
"""

from __future__ import annotations

import datetime as dt
import hashlib
import heapq
import itertools
import json
import resource
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from batch_pipeline.lib import contract as c
from batch_pipeline.lib import ids, storage
from batch_pipeline.lib.engine import Answer, Engines
from batch_pipeline.lib.validation import InvalidLine, ValidationSettings, validate_stream

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
    return [
        BatchLocation(name=batch_name(o.uri), input_uri=o.uri, output_uri=storage.join(base, batch_name(o.uri)), partition=partition)
        for o in found
    ]


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

        def on_valid(req: c.BatchRequest) -> None:
            valid_out.write(_dumps(req.model_dump()))

        def on_invalid(bad: InvalidLine) -> None:
            invalid_out.write(_dumps(asdict(bad)))
            log(f"{loc.name}: {bad.code} at line {bad.line}")

        summary = validate_stream(src, settings, on_valid, on_invalid)
    file_error = summary.file_error()
    info = {
        "batch_id": ids.batch_id(f"{loc.input_uri}\0{summary.sha256}\0{loc.partition}"),
        "name": loc.name,
        "input_uri": loc.input_uri,
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


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def shard_fingerprint(validation: dict[str, Any], identity: dict[str, Any], shard_size: int) -> str:
    """What a shard's answers depend on: a checkpoint made for other input or another model is never reused."""
    payload = json.dumps({"sha256": validation["sha256"], "engine": identity, "shard_size": shard_size}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Progress:
    """Rate and ETA for long work, logged once per shard."""

    def __init__(self, total: int, log: Log, label: str):
        self.total, self.log, self.label = total, log, label
        self.done = self.output_tokens = 0
        self.started = time.perf_counter()

    def advance(self, requests: int, output_tokens: int, skipped: bool = False, excluded_seconds: float = 0.0) -> None:
        """Count finished requests; `excluded_seconds` (model loading) is kept out of the rate."""
        self.done += requests
        self.output_tokens += output_tokens
        elapsed = max(time.perf_counter() - self.started - excluded_seconds, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        how = "resumed from checkpoint" if skipped else f"{rate:.2f} req/s, {self.output_tokens / elapsed:.1f} output tok/s"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        self.log(f"{self.label}: {self.done}/{self.total} requests ({pct:.0f}%), {how}, ETA {eta:.0f}s")


def infer_batch(
    loc: BatchLocation, engines: Engines, identity: dict[str, Any], shard_size: int, log: Log = _quiet
) -> dict[str, Any]:
    """Answer every valid request, shard by shard; finished shards are reused, not recomputed."""
    validation = read_json(loc.work("validation.json"))
    fingerprint = shard_fingerprint(validation, identity, shard_size)
    shard_dir = loc.work("shards", fingerprint)
    done = {storage.basename(o.uri) for o in storage.list_objects(shard_dir, recursive=False)}
    started_at = now()
    started = time.perf_counter()
    load_before = engines.load_seconds
    progress = Progress(validation["valid"], log, loc.name)
    reused = 0
    for index, chunk in enumerate(_chunks(_iter_jsonl(loc.work("requests.jsonl")), shard_size)):
        name = f"shard-{index:05d}.jsonl"
        if name in done:
            reused += 1
            progress.advance(len(chunk), 0, skipped=True)
            continue
        requests = [c.BatchRequest.model_validate(r) for r in chunk]
        answers = engines.run(validation["batch_id"], requests, created=now())
        _check_exactly_once(requests, answers)
        storage.write_bytes(storage.join(shard_dir, name), b"".join(_dumps(asdict(a)) for a in answers))
        progress.advance(
            len(chunk), sum(a.completion_tokens for a in answers), excluded_seconds=engines.load_seconds - load_before
        )
    elapsed = time.perf_counter() - started
    load_seconds = engines.load_seconds - load_before
    info = {
        "fingerprint": fingerprint,
        "engine": identity,
        "shard_size": shard_size,
        "shards_reused": reused,
        "in_progress_at": started_at,
        "finished_at": now(),
        "model_load_seconds": round(load_seconds, 3),
        "inference_seconds": round(max(elapsed - load_seconds, 0.0), 3),
    }
    _write_json(loc.work("inference.json"), info)
    return info


def _check_exactly_once(requests: list[c.BatchRequest], answers: list[Answer]) -> None:
    asked = sorted(r.line for r in requests)
    answered = sorted(a.line for a in answers)
    if asked != answered:
        raise RuntimeError(f"engine answered lines {answered[:5]}... for requests {asked[:5]}...: not exactly once")


# --------------------------------------------------------------------------------------------
# Finalizing: the three contract files
# --------------------------------------------------------------------------------------------


def _shard_answers(loc: BatchLocation, fingerprint: str) -> Iterator[dict[str, Any]]:
    shard_dir = loc.work("shards", fingerprint)
    for obj in storage.list_objects(shard_dir, recursive=False):
        yield from sorted(_iter_jsonl(obj.uri), key=lambda a: a["line"])


def finalize_batch(loc: BatchLocation, extra_metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write output.jsonl, errors.jsonl and batch.json from the validation and shard files."""
    started = time.perf_counter()
    validation = read_json(loc.work("validation.json"))
    batch_seed = validation["batch_id"]
    inference = read_json(loc.work("inference.json")) if validation["valid"] else None
    counts = {"output": 0, "error": 0, "input_tokens": 0, "output_tokens": 0}
    answers = _shard_answers(loc, inference["fingerprint"]) if inference else iter(())
    invalid = (
        {"line": d["line"], "kind": "error", "record": InvalidLine(**d).to_error_line(batch_seed)}
        for d in _iter_jsonl(loc.work("invalid.jsonl"))
    )
    with storage.open_write(loc.out("output.jsonl")) as out, storage.open_write(loc.out("errors.jsonl")) as err:
        for answer in heapq.merge(invalid, answers, key=lambda a: a["line"]):
            target = out if answer["kind"] == "output" else err
            target.write(_dumps(answer["record"]))
            counts[answer["kind"]] += 1
            counts["input_tokens"] += answer.get("prompt_tokens", 0)
            counts["output_tokens"] += answer.get("completion_tokens", 0)
    if counts["output"] + counts["error"] != validation["lines"]:
        raise RuntimeError(
            f"{loc.name}: {validation['lines']} lines in, {counts['output']} answers + {counts['error']} errors out"
        )
    finished = now()
    file_error = validation["file_error"]
    status = "failed" if file_error else "completed"
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
        finalizing_at=inference["finished_at"] if inference else finished,
        completed_at=finished if status == "completed" else None,
        failed_at=finished if status == "failed" else None,
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
        "output_tokens_per_second": per_second(usage["output_tokens"]),
        "total_tokens_per_second": per_second(usage["total_tokens"]),
        "peak_memory_mb": peak_memory_mb(),
        "shards_reused": int(inference.get("shards_reused", 0)),
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
        ("output_tokens_per_second", "output_tokens"),
        ("total_tokens_per_second", "total_tokens"),
    ):
        totals[key] = round(totals[numerator] / seconds, 3) if seconds > 0 else 0.0
    totals["batches"] = len(per_batch)
    totals["peak_memory_mb"] = max((m["peak_memory_mb"] for m in per_batch), default=peak_memory_mb())
    for key in ("served_model_name", "engine", "model_path", "model_revision"):
        values = sorted({str(m[key]) for m in per_batch if key in m})
        if values:
            totals[key] = ", ".join(values)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in totals.items()}

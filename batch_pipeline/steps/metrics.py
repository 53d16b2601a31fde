"""Throughput figures: per batch (metrics.json) and summed over the batches of a run."""

from __future__ import annotations

from typing import Any

from batch_pipeline.base.runtime import peak_memory_mb
from batch_pipeline.io import storage
from batch_pipeline.io.locations import BatchLocation


# A batch's cost, as batch.json's metadata keeps it (strings, as the openai SDK keeps metadata).
COST_PREFIX = "cost_"
COST_FIELDS = ("gpus", "engine_seconds", "gpu_seconds", "model_load_seconds", "input_tokens", "output_tokens")


def batch_cost(inference: dict[str, Any], usage: dict[str, Any]) -> dict[str, float | int]:
    """What a batch cost, from its inference record and its Batch object's usage: engine-seconds (the
    model load and the answering, this batch's share of them when answered with others), the GPUs
    its engines used (TENSOR_PARALLEL_SIZE x ranks, capped by those its process sees through NVML;
    0 on the CPU), GPU-seconds (engine-seconds x GPUs), the model load on its own, tokens in and out.
    Only the attempt that finished the batch is counted: one that crashed part way is not."""
    load = float(inference.get("model_load_seconds", 0.0))
    engine = load + float(inference.get("inference_seconds", 0.0))
    gpus = int((inference.get("gpu") or {}).get("gpu_count", 0))  # visible to the process (NVML); 0 on the CPU
    if gpus and inference.get("engine_gpus"):
        gpus = min(gpus, int(inference["engine_gpus"]))  # a run given 8 GPUs whose engine uses 2 costs 2
    return {"gpus": gpus, "engine_seconds": round(engine, 3), "gpu_seconds": round(engine * gpus, 3),
            "model_load_seconds": round(load, 3), "input_tokens": int(usage.get("input_tokens", 0)),
            "output_tokens": int(usage.get("output_tokens", 0))}


def cost_metadata(cost: dict[str, float | int]) -> dict[str, str]:
    """batch_cost as Batch metadata entries: `cost_gpu_seconds`: "12.5", ..."""
    return {COST_PREFIX + name: str(cost[name]) for name in COST_FIELDS}


def cost_of_metadata(metadata: dict[str, Any] | None) -> dict[str, float] | None:
    """batch_cost back from Batch metadata (None when it holds none: a batch written before costs were)."""
    metadata = metadata or {}
    if not all(COST_PREFIX + name in metadata for name in COST_FIELDS):
        return None
    return {name: float(metadata[COST_PREFIX + name]) for name in COST_FIELDS}


def batch_metrics(loc: BatchLocation) -> dict[str, Any]:
    """Throughput figures of one batch from its result and work files, written to metrics.json.

    Every figure comes from what the steps recorded when they did the work (inference.json keeps
    the timings and peak memory of the run that answered), so measuring again, e.g. in a later run
    that found nothing left to do, writes the same figures.
    """
    batch = storage.read_json(loc.out("batch.json"))
    validation = storage.read_json(loc.work("validation.json"))
    inference = storage.read_json(loc.work("inference.json")) if validation["valid"] else {}
    finalize = storage.read_json(loc.work("finalize.json"))
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
        "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
        # Of the prompt tokens, the share vLLM's prefix cache served (ORDER=planned raises it).
        "prefix_cache_hit_rate": round(usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"], 4)
        if usage["input_tokens"] else 0.0,
        "output_tokens": usage["output_tokens"],
        "total_tokens": usage["total_tokens"],
        "model_load_seconds": float(inference.get("model_load_seconds", 0.0)),
        "validation_seconds": float(validation["seconds"]),
        "ordering": str(inference.get("ordering", "input")),
        "planning_seconds": float(inference.get("planning_seconds", 0.0)),
        **({"engine_idle_share": float(inference["engine_idle_share"])} if "engine_idle_share" in inference else {}),
        # A warm engine's run: which server answered, how busy it was and this run's share of its tokens.
        **{k: inference[k] for k in ("engine_url", "engine_busy_share", "engine_token_share") if k in inference},
        "inference_seconds": infer_s,
        **{k: v for k, v in batch_cost(inference, usage).items() if k in ("gpus", "engine_seconds", "gpu_seconds")},
        "writing_seconds": float(finalize["seconds"]),
        "requests_per_second": per_second(counts["completed"]),
        "input_tokens_per_second": per_second(usage["input_tokens"]),
        "output_tokens_per_second": per_second(usage["output_tokens"]),
        "total_tokens_per_second": per_second(usage["total_tokens"]),
        "peak_memory_mb": float(inference.get("peak_memory_mb") or peak_memory_mb()),
        "resumed_requests": int(inference.get("resumed_requests", 0)),
        "checkpoint_parts": int(inference.get("checkpoint_parts", 0)),
        "checkpoint_write_seconds": float(inference.get("checkpoint_write_seconds", 0.0)),
        # Balance over the engines: requests each data-parallel rank answered in the run that did
        # the work (answers resumed from checkpoints are not counted again).
        "data_parallel_size": int(inference.get("data_parallel_size", 1)),
        "shards": int(inference.get("shards", 1)),
        "requests_per_rank": list(inference.get("requests_per_rank", [int(inference.get("computed_requests", 0))])),
        **inference.get("gpu", {}),
        **inference.get("engine", {}),
    }
    storage.write_json(loc.out("metrics.json"), metrics)
    return metrics


def date_batch_folders(output_root: str, partition: str, marker: str) -> list[str]:
    """The result folders `<output_root>/<date>/<name>` of one date that hold `marker` (e.g.
    batch.json), whichever runs wrote them."""
    folder = storage.join(output_root, partition)
    prefix = storage.join(folder, "x")[:-1]
    depth = 1 + marker.count("/")  # "<name>/batch.json", "<name>/_work/validation.json"
    return [
        info.uri[: -len(marker) - 1]
        for info in storage.list_objects(folder, suffix=marker.rsplit("/", 1)[-1])
        if info.uri[len(prefix):].count("/") == depth and info.uri.endswith("/" + marker)
    ]


DATE_TABLE = "metrics.parquet"  # <output>/<date>/metrics.parquet: the date's metrics.json files as one table


def date_metrics(output_root: str, partition: str) -> list[dict[str, Any]]:
    """The metrics.json of every batch of one date (with its folder's name as `batch`): the date's
    figures, not only the last run's."""
    return [{"batch": storage.basename(f), **storage.read_json(storage.join(f, "metrics.json"))}
            for f in date_batch_folders(output_root, partition, "metrics.json")]


def date_validations(output_root: str, partition: str) -> list[dict[str, Any]]:
    """Line counts of every batch of one date that has been validated, whichever runs did it:
    {"batch", "lines", "valid", "invalid"} each."""
    found = []
    for folder in date_batch_folders(output_root, partition, "_work/validation.json"):
        validation = storage.read_json(storage.join(folder, "_work", "validation.json"))
        found.append({"batch": storage.basename(folder), **{k: int(validation[k]) for k in ("lines", "valid", "invalid")}})
    return found


def line_failures(output_uri: str) -> dict[str, Any]:
    """A batch's failed lines for the failed_line_rate check: status and counts from batch.json, the
    codes of the lines validation refused (its errors_by_code) and where the error file is."""
    batch = storage.read_json(storage.join(output_uri, "batch.json"))
    try:
        codes = storage.read_json(storage.join(output_uri, "_work", "validation.json")).get("errors_by_code", {})
    except FileNotFoundError:
        codes = {}
    counts = batch["request_counts"]
    return {"batch": storage.basename(output_uri), "status": batch["status"], "failed": counts["failed"], "total": counts["total"],
            "rate": counts["failed"] / counts["total"] if counts["total"] else 0.0,
            "codes": {str(k): int(v) for k, v in codes.items()}, "errors": batch.get("error_file_id") or ""}


def date_line_failures(output_root: str, partition: str) -> list[dict[str, Any]]:
    """line_failures() of every batch of one date with a batch.json, whichever runs wrote them."""
    return [line_failures(folder) for folder in date_batch_folders(output_root, partition, "batch.json")]


_SUMMED = (
    "requests_total", "requests_completed", "requests_failed", "input_tokens", "output_tokens", "total_tokens",
    "model_load_seconds", "validation_seconds", "planning_seconds", "inference_seconds", "writing_seconds",
    "cached_tokens",
    "checkpoint_parts", "checkpoint_write_seconds",
    "engine_seconds", "gpu_seconds",
)
_RATES = (
    ("requests_per_second", "requests_completed"),
    ("input_tokens_per_second", "input_tokens"),
    ("output_tokens_per_second", "output_tokens"),
    ("total_tokens_per_second", "total_tokens"),
)


def aggregate_metrics(per_batch: list[dict[str, Any]]) -> dict[str, Any]:
    """One set of figures for the batches of a run (what the Dagster UI plots per partition).

    With no batches there are no figures, only `batches: 0`: a run that had nothing to do must not
    plot zeros over the real throughput of the run that did the work.
    """
    if not per_batch:
        return {"batches": 0}
    totals: dict[str, Any] = {key: sum(m.get(key, 0) for m in per_batch) for key in _SUMMED}
    seconds = totals["inference_seconds"]
    for key, numerator in _RATES:
        totals[key] = round(totals[numerator] / seconds, 3) if seconds > 0 else 0.0
    totals["batches"] = len(per_batch)
    totals["prefix_cache_hit_rate"] = round(totals["cached_tokens"] / totals["input_tokens"], 4) if totals["input_tokens"] else 0.0
    gpu_util = [m["gpu_utilization_mean_pct"] for m in per_batch if "gpu_utilization_mean_pct" in m]
    if gpu_util:
        totals["gpu_utilization_mean_pct"] = round(sum(gpu_util) / len(gpu_util), 1)
        totals["gpu_memory_peak_mb"] = max(m["gpu_memory_peak_mb"] for m in per_batch if "gpu_memory_peak_mb" in m)
    totals["peak_memory_mb"] = max(m["peak_memory_mb"] for m in per_batch)
    totals["gpus"] = max(int(m.get("gpus", 0)) for m in per_batch)
    totals["data_parallel_size"] = max(int(m.get("data_parallel_size", 1)) for m in per_batch)
    totals["shards"] = max(int(m.get("shards", 1)) for m in per_batch)
    per_rank = [0] * totals["data_parallel_size"]
    for m in per_batch:
        for rank, count in enumerate(m.get("requests_per_rank", [])):
            if rank < len(per_rank):
                per_rank[rank] += int(count)
    totals["requests_per_rank"] = per_rank
    for key in ("served_model_name", "engine", "model_path", "model_revision", "ordering"):
        values = sorted({str(m[key]) for m in per_batch if key in m})
        if values:
            totals[key] = ", ".join(values)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in totals.items()}

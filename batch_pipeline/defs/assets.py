"""The batch assets: validate the day's batch files, answer them with vLLM, write the results, measure."""


import os
from typing import Any

import dagster as dg
from pydantic import Field

from batch_pipeline.defs.partitions import daily_partitions
from batch_pipeline.defs.resources import LLMResource, StorageResource
from batch_pipeline.lib import batches as b

DEFAULT_MAX_FAILED_RATE = 0.10


class BatchConfig(dg.Config):
    """Which batch files a run covers; blank means every file of the partition's date."""

    input_uri: str = Field(
        default="",
        description="A batch file, or a folder/prefix of them; blank = STORAGE_INPUT_PATH/<partition date>/",
    )
    output_uri: str = Field(
        default="",
        description="Result folder for a single input file; blank = STORAGE_OUTPUT_PATH/<date>/<batch name>/",
    )
    skip_completed: bool = Field(
        default=True,
        description="For a whole date (blank input_uri): leave out batches an earlier run completed from the same file",
    )


def locate(context: dg.AssetExecutionContext, config: BatchConfig, storage: StorageResource) -> list[b.BatchLocation]:
    s = storage.settings()
    locations = b.resolve_batches(config.input_uri, config.output_uri, s.input_path, s.output_path, context.partition_key)
    if not config.input_uri and config.skip_completed:
        # The nightly schedule and backfills take "every file of the date not yet processed".
        done = [loc for loc in locations if b.is_completed_elsewhere(loc, context.run.run_id)]
        if done:
            context.log.info(f"{len(done)} batch(es) already completed by earlier runs: {', '.join(d.name for d in done)}")
        locations = [loc for loc in locations if loc not in done]
    if not locations:
        context.log.info(f"no batch files to process for {context.partition_key}")
    return locations


def _table(rows: list[dict[str, Any]]) -> dg.MetadataValue:
    if not rows:
        return dg.MetadataValue.md("(no batches)")
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return dg.MetadataValue.md("\n".join(lines))


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"python"},
    description="Every line of the date's OpenAI Batch files, split into valid requests and error lines.",
)
def validated_requests(
    context: dg.AssetExecutionContext, config: BatchConfig, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    settings = llm.validation_settings()
    rows = []
    for loc in locate(context, config, storage):
        info = b.validate_batch(loc, settings, log=b.first_n_logger(context.log.info, 20))
        context.log.info(f"{loc.name}: {info['lines']} lines, {info['valid']} valid, {info['invalid']} invalid")
        rows.append({"batch": loc.name, "lines": info["lines"], "valid": info["valid"], "invalid": info["invalid"]})
    return dg.MaterializeResult(
        metadata={
            "batches": len(rows),
            "lines": sum(r["lines"] for r in rows),
            "valid": sum(r["valid"] for r in rows),
            "invalid": sum(r["invalid"] for r in rows),
            "summary": _table(rows),
        }
    )


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"vllm"},
    deps=[validated_requests],
    pool="gpu",
    # A crashed engine fails the step; the retry resumes from the checkpoints instead of from zero.
    retry_policy=dg.RetryPolicy(max_retries=2, delay=5),
    description="One answer per valid request from vLLM offline inference, checkpointed as it goes.",
)
def inference_results(
    context: dg.AssetExecutionContext, config: BatchConfig, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    locations = locate(context, config, storage)
    pending = [loc for loc in locations if b.read_json(loc.work("validation.json"))["valid"] > 0]
    rows, load_seconds, infer_seconds = [], 0.0, 0.0
    if pending:
        checkpoint_every = llm.settings().shard_size
        with llm.open(log=context.log.info) as engines:
            identity = llm.identity()
            for i, loc in enumerate(pending):
                try:
                    info = b.infer_batch(loc, engines, identity, checkpoint_every, log=context.log.info)
                except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt):
                    # Terminated from the UI (or Ctrl-C): keep what is answered, say "cancelled".
                    for cancelled in pending[i:]:
                        b.finalize_batch(cancelled, {"dagster_run_id": context.run.run_id}, cancelled=True)
                        context.log.warning(f"{cancelled.name}: cancelled; the next run resumes the rest")
                    raise
                load_seconds += info["model_load_seconds"]
                infer_seconds += info["inference_seconds"]
                rows.append({"batch": loc.name, "resumed": info["resumed_requests"], "seconds": info["inference_seconds"]})
    return dg.MaterializeResult(
        metadata={
            "batches": len(rows),
            "model_load_seconds": round(load_seconds, 3),
            "inference_seconds": round(infer_seconds, 3),
            "summary": _table(rows),
        }
    )


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"python"},
    deps=[inference_results],
    check_specs=[
        dg.AssetCheckSpec(
            "failed_line_rate",
            asset="batch_outputs",
            description="Share of failed lines stays under MAX_FAILED_LINE_RATE (default 10%).",
        )
    ],
    description="OpenAI-compatible output.jsonl, errors.jsonl and batch.json for each of the date's batches.",
)
def batch_outputs(
    context: dg.AssetExecutionContext, config: BatchConfig, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    rows = []
    for loc in locate(context, config, storage):
        batch = b.finalize_batch(loc, extra_metadata={"dagster_run_id": context.run.run_id})
        counts = batch["request_counts"]
        context.log.info(
            f"{loc.name}: {batch['status']}, {counts['completed']} completed, {counts['failed']} failed -> {loc.output_uri}"
        )
        rows.append({"batch": loc.name, "status": batch["status"], **counts, "output": loc.output_uri})
    failed = [r["batch"] for r in rows if r["status"] == "failed"]
    metadata = {
        "batches": len(rows),
        "completed": sum(r["completed"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        "total": sum(r["total"] for r in rows),
        "summary": _table(rows),
    }
    if failed:
        # The files are written either way; the run goes red so the failure is seen.
        raise dg.Failure(description=f"batch failed (file-level error): {', '.join(failed)}", metadata=metadata)
    return dg.MaterializeResult(metadata=metadata, check_results=[failed_line_rate(metadata["failed"], metadata["total"])])


def failed_line_rate(failed: int, total: int) -> dg.AssetCheckResult:
    """Per-request failures are data: gated by rate (a warning), not by failing the run."""
    limit = float(os.environ.get("MAX_FAILED_LINE_RATE", DEFAULT_MAX_FAILED_RATE))
    rate = failed / total if total else 0.0
    return dg.AssetCheckResult(
        check_name="failed_line_rate",
        passed=rate <= limit,
        severity=dg.AssetCheckSeverity.WARN,
        description=f"{failed} of {total} lines failed ({rate:.1%}); limit {limit:.0%}",
        metadata={"failed_rate": round(rate, 4), "failed": failed, "total": total, "limit": limit},
    )


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"python"},
    deps=[batch_outputs],
    description="Throughput of the date's batches: requests/s, tokens/s, time split, peak memory.",
)
def throughput_metrics(
    context: dg.AssetExecutionContext, config: BatchConfig, storage: StorageResource
) -> dg.MaterializeResult:
    per_batch = [b.batch_metrics(loc) for loc in locate(context, config, storage)]
    return dg.MaterializeResult(metadata=b.aggregate_metrics(per_batch))


BATCH_ASSETS = [validated_requests, inference_results, batch_outputs, throughput_metrics]

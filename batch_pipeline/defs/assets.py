"""The batch assets: validate the day's batch files, answer them with vLLM, write the results, measure."""


import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import dagster as dg

from batch_pipeline.defs import file_status
from batch_pipeline.defs.partitions import daily_partitions
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource, answering_pool
from batch_pipeline.defs.run_watch import CancelWatch, yielding_to_urgent_runs
from batch_pipeline.io import checkpoints, locations, tables
from batch_pipeline import contract
from batch_pipeline.steps import metrics
from batch_pipeline.base import progress
from batch_pipeline.engine import vllm_adapter
from batch_pipeline.engine.engine_args import require_hardware
from batch_pipeline.steps.ingest import validate_batch
from batch_pipeline.steps.inference import answered_in_full, infer_batches
from batch_pipeline.io.locations import BatchLocation, RunBatches
from batch_pipeline.steps.results import finalize_batch
from batch_pipeline.config.priority import run_priority
from batch_pipeline.config.settings import DEFAULT_MAX_FAILED_LINE_RATE, ConfigError, max_failed_line_rate_from_env
from batch_pipeline.io.shards import Shard, merge_if_complete, reusable_validation
from batch_pipeline.io.storage import join as storage_join
from batch_pipeline.io.storage import exists, read_json

DEFAULT_MAX_FAILED_RATE = DEFAULT_MAX_FAILED_LINE_RATE
# A crashed engine fails the answering step; it is retried twice, RETRY_DELAY_SECONDS after the
# failure. The wait is in the step (answer_batches), not Dagster's RetryPolicy delay: an interrupt
# (Ctrl-C, a terminate from the UI) during Dagster's wait was only seen as the retry began, before
# any of the step's own code, so the batch was neither cancelled nor reported as such.
INFERENCE_RETRIES = dg.RetryPolicy(max_retries=2)
RETRY_DELAY_SECONDS = 5.0


def _shard(batch: BatchSelection) -> Shard:
    try:
        shard = Shard.parse(batch.shard)
    except ConfigError as e:
        raise dg.Failure(description=str(e), allow_retries=False) from None
    if batch.expires_at and not shard.whole:
        raise dg.Failure(description="batch.expires_at applies to whole batches; leave batch.shard blank with it",
                         allow_retries=False)
    return shard


def _endpoint(batch: BatchSelection) -> str | None:
    if batch.endpoint and batch.endpoint not in contract.SUPPORTED_URLS:
        raise dg.Failure(description=f"batch.endpoint {batch.endpoint!r} is not one of {', '.join(contract.SUPPORTED_URLS)}",
                         allow_retries=False)
    return batch.endpoint or None


def _assembled(loc: BatchLocation, shard: Shard, merge: bool = False) -> bool:
    """Whether the batch's results can be written: always for a whole batch; for a shard, once
    every shard of the batch has finished. With `merge` (the output step), inference.json is then
    written with their merged record: shards finishing at the same moment may each have missed
    the other's record when they finished answering."""
    if shard.whole or not read_json(loc.work("validation.json"))["valid"]:
        return True
    own = read_json(loc.work(shard.record_name()))
    finished, _ = merge_if_complete(loc, own["checkpoint_key"], shard.count, write=merge)
    return finished == shard.count


def _measured_here(loc: BatchLocation, shard: Shard, run_id: str) -> bool:
    """Whether throughput_metrics measures the batch in this run: a whole batch always (a later run with
    nothing left to do records its figures again); a shard's only when this run's batch_outputs wrote
    its results (batch.json names the run). Asking _assembled again here is not the same: a shard that
    found the others unfinished at its output step can find them all finished a moment later, while the
    last one is still writing batch.json (two shard runs ending together failed reading it)."""
    if shard.whole:
        return True
    batch_uri = loc.out("batch.json")
    if not exists(batch_uri):
        return False
    return (read_json(batch_uri).get("metadata") or {}).get("dagster_run_id") == run_id


def _in_date_layout(taken: list[BatchLocation], output_root: str) -> bool:
    """Whether every batch of the run writes to its date's folder (<output>/<date>/<name>/), where
    the date's other batches are too: then the run's figures and check can be the date's."""
    return all(file_status.in_date_layout(loc, output_root) for loc in taken)


def _runs_folder(batch: BatchSelection, storage: StorageResource, partition: str) -> str:
    s = storage.settings()
    return locations.runs_folder(batch.input_uri, batch.output_uri, s.output_path, partition, several=bool(batch.input_uris))


def already_done(loc: BatchLocation, identity: Callable[[], dict[str, Any]]) -> bool:
    batch = locations.completed_batch(loc)
    if batch is None:
        return False
    # Answers from another model or other engine settings are not "done" for this run's model.
    key = checkpoints.checkpoint_key(batch["metadata"].get("input_sha256", ""), identity())
    return batch["metadata"].get("checkpoint_key") == key


def take_batches(
    context: dg.AssetExecutionContext, batch: BatchSelection, storage: StorageResource, llm: LLMResource
) -> list[BatchLocation]:
    """The first step of a run: find the batches, leave out finished ones, record the list."""
    s = storage.settings()
    if batch.input_uris:
        if batch.input_uri or batch.output_uri:
            raise dg.Failure(description="batch.input_uris names several files of the date; leave input_uri and "
                             "output_uri blank with it", allow_retries=False)
        found = locations.resolve_files(batch.input_uris, s.output_path, context.partition_key, log=context.log.warning)
    else:
        found = locations.resolve_batches(batch.input_uri, batch.output_uri, s.input_path, s.output_path, context.partition_key)
    identity = functools.cache(llm.identity)  # computed once, and only when a completed batch is found
    skipped = [loc for loc in found if batch.skip_completed and already_done(loc, identity)]
    if skipped:
        context.log.info(
            f"{len(skipped)} batch(es) already completed from the same file with this model, left as they are: "
            + ", ".join(loc.name for loc in skipped)
        )
    taken = RunBatches(context.run.root_run_id or context.run.run_id, tuple(loc for loc in found if loc not in skipped),
                       tuple(loc.name for loc in skipped))
    taken.write(_runs_folder(batch, storage, context.partition_key))
    if not taken.batches:
        context.log.info(f"no batch files to process for {context.partition_key}")
    return list(taken.batches)


def run_batches(context: dg.AssetExecutionContext, batch: BatchSelection, storage: StorageResource) -> list[BatchLocation]:
    """The batches this run's first step took (also across retries and re-executions of the run).

    A file that arrived in the date's folder after the first step is not among them: it is left
    for the next run or the upload sensor.
    """
    run_id = context.run.root_run_id or context.run.run_id
    taken = RunBatches.read(_runs_folder(batch, storage, context.partition_key), run_id)
    if taken is None:
        raise dg.Failure(
            description=(
                f"run {run_id} has no record of its batches: {context.asset_key.to_user_string()} was started "
                "without validated_requests; materialize validated_requests in the same run first"
            )
        )
    return list(taken.batches)


def _summary(rows: list[dict[str, Any]], *summed: str) -> dict[str, Any]:
    """Step metadata: the number of batches, totals of the `summed` columns, and the table."""
    return {"batches": len(rows), **{key: sum(r[key] for r in rows) for key in summed}, "summary": _table(rows)}


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
    context: dg.AssetExecutionContext, batch: BatchSelection, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    taken = take_batches(context, batch, storage, llm)
    output_root = storage.settings().output_path
    file_status.plan(context, taken, output_root)  # each file shows in progress in batch_files
    rows = validate_batches(context, taken, llm, _shard(batch), _endpoint(batch), batch.image_column)
    import_engine_ahead(context, taken, rows, llm, _shard(batch))
    if taken and not _in_date_layout(taken, output_root):
        return dg.MaterializeResult(metadata={**_summary(rows, "lines", "valid", "invalid"),
                                              "batches_this_run": len(rows), "scope": "this run's batches"})
    # The date's line counts, whichever runs validated its batches: a sensor run for one file does
    # not replace the date's figures with that file's. A date run with nothing left to do (e.g. after
    # a file was re-run alone) records them as they are; a date without batches (or results written
    # elsewhere) gets no figures, so the plots keep the date's real ones (no zeros).
    whole_date = [] if not taken and batch.output_uri else metrics.date_validations(output_root, context.partition_key)
    if not whole_date:
        return dg.MaterializeResult(metadata={"batches": 0})
    return dg.MaterializeResult(metadata={
        **_summary(whole_date, "lines", "valid", "invalid"), "batches_this_run": len(rows),
        "this_run": _table(rows), "scope": f"every batch of {context.partition_key}",
    })


def import_engine_ahead(context: dg.AssetExecutionContext, taken: list[BatchLocation], rows: list[dict[str, Any]],
                        llm: LLMResource, shard: Shard) -> None:
    """Import vLLM here, not in inference_results, when that step will build an engine in this process
    (valid lines not yet answered, one rank: ranks import it in their own processes). The GPU step
    holds its pool slot from start to end, and the import is 10-30 s of CPU: done here, a run that
    waits for the GPU loads its model as soon as the slot frees, and no run holds the GPU to import."""
    try:
        settings = llm.settings()
        if settings.engine_url or settings.data_parallel_size > 1 or not any(row["valid"] for row in rows):
            return  # a warm engine's run imports no vLLM; ranks import it in their own processes
        identity = llm.identity()
        if all(answered_in_full(loc, identity, shard) for loc, row in zip(taken, rows) if row["valid"]):
            return
    except (ConfigError, OSError, KeyError):  # a setting or a record the GPU step reports better
        return
    took = vllm_adapter.import_vllm()
    if took is not None:
        context.log.info(f"vLLM imported ahead of the GPU step in {took:.1f}s")


def validate_batches(context: dg.AssetExecutionContext, taken: list[BatchLocation], llm: LLMResource,
                     shard: Shard, endpoint: str | None = None, image_column: str = "") -> list[dict[str, Any]]:
    """Validate each batch (a shard reuses another shard's validation of the same file version);
    with `endpoint`, lines of another url are url_mismatch errors; with `image_column`, a table's
    images are taken from that column."""
    settings = dataclasses.replace(llm.validation_settings(), endpoint=endpoint, image_column=image_column)
    rows = []
    for loc in taken:
        info = None if shard.whole else reusable_validation(loc)
        if info is not None:  # another shard of this batch validated this very file already
            context.log.info(f"{loc.name}: validation of this file version by another shard reused")
        else:
            info = validate_batch(loc, settings, log=progress.first_n_logger(context.log.info, 20))
        context.log.info(f"{loc.name}: {info['lines']} lines, {info['valid']} valid, {info['invalid']} invalid")
        rows.append({"batch": loc.name, "lines": info["lines"], "valid": info["valid"], "invalid": info["invalid"]})
    return rows


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"vllm"},
    deps=[validated_requests],
    pool=answering_pool(),
    # A crashed engine fails the step; the retry resumes from the checkpoints instead of from zero.
    retry_policy=INFERENCE_RETRIES,
    description="One answer per valid request from vLLM offline inference, checkpointed as it goes.",
)
def inference_results(
    context: dg.AssetExecutionContext, batch: BatchSelection, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata=answer_batches(context, run_batches(context, batch, storage), llm, _shard(batch),
                                                        deadline=batch.expires_at or None))


def answer_batches(context: dg.AssetExecutionContext, batches: list[BatchLocation], llm: LLMResource,
                   shard: Shard, deadline: float | None = None) -> dict[str, Any]:
    """Answer the valid requests of each batch on one engine (one model load); step metadata.
    Past `deadline` (Unix time), what is left of each batch expires (see infer_batch). A retry
    (context.retry_number) first waits RETRY_DELAY_SECONDS, inside the interrupt handling."""
    validated = [(loc, read_json(loc.work("validation.json"))) for loc in batches]
    pending = [loc for loc, validation in validated if validation["valid"] > 0]
    rows, load_seconds, infer_seconds = [], 0.0, 0.0
    if pending:
        settings = llm.settings()
        identity: dict[str, Any] | None = None  # known once the engines are open
        try:
            # Inside the interrupt handling: a terminate that lands here (the retry's wait; the
            # hardware check imports torch, seconds on a loaded machine) cancels like one that lands
            # while answering, instead of being turned into a retry by the step's RetryPolicy.
            if context.retry_number:
                context.log.info(f"attempt {context.retry_number + 1} of {INFERENCE_RETRIES.max_retries + 1}: "
                                 f"resuming in {RETRY_DELAY_SECONDS:g} s (terminate or Ctrl-C cancels)")
                time.sleep(RETRY_DELAY_SECONDS)
            try:
                if not settings.engine_url:  # a warm engine's run needs no GPU of its own
                    require_hardware(settings)
                registry = list(settings.model_registry())
            except ConfigError as e:  # a setting, not a crash: retrying cannot help
                raise dg.Failure(description=str(e), allow_retries=False) from None
            # The batches of one model together (MODELS_FILE: one model after another, so each
            # loads once); ORDER=planned answers each group as one planned stream.
            order = {name: i + 1 for i, name in enumerate(registry)}
            models = {loc.name: validation["model"] for loc, validation in validated}
            groups: dict[int, list[BatchLocation]] = {}
            for loc in pending:
                groups.setdefault(order.get(models[loc.name], 0), []).append(loc)
            # The watch: a cancel whose interrupt never came still stops the answering (run_watch.py).
            watch = CancelWatch(context.instance, context.run.run_id, context.log.warning)
            with llm.open(log=context.log.info, priority=run_priority(context.run.tags)) as engines, watch.running(), \
                    yielding_to_urgent_runs(context.instance, context.run, engines):
                identity = llm.identity()
                for _, group in sorted(groups.items()):
                    infos = infer_batches(
                        group, engines, identity, settings.checkpoint_answers, settings.checkpoint_seconds,
                        log=context.log.info, shard=shard, deadline=deadline, order=settings.order,
                        cancelled=watch.requested,
                    )
                    for loc, info in zip(group, infos):
                        if info["computed_requests"]:
                            load_seconds += info["model_load_seconds"]
                            infer_seconds += info["inference_seconds"]
                        rows.append({
                            "batch": loc.name,
                            "resumed": info["resumed_requests"],
                            "computed": info["computed_requests"],
                            "seconds": info["inference_seconds"] if info["computed_requests"] else 0.0,
                        })
        except (dg.DagsterExecutionInterruptedError, KeyboardInterrupt) as interrupt:
            # Terminated from the UI (or Ctrl-C), while loading, answering or shutting the engine
            # down: keep what is answered, say "cancelled". A shard writes no results: the other
            # shards may still be answering theirs.
            left = [loc for loc in pending if identity is None or not answered_in_full(loc, identity, shard)]
            for cancelled in left if shard.whole else ():
                finalize_batch(cancelled, {"dagster_run_id": context.run.run_id}, cancelled=True)
                context.log.warning(f"{cancelled.name}: cancelled; the next run resumes the rest")
            what = ", ".join(c.name for c in left) if left else (
                "nothing (every answer was in; interrupted while the engine shut down)")
            # Not the interrupt itself: Dagster turns an interrupt inside a step with a RetryPolicy
            # into a retry, which would at once resume (or reload the model for) what was just cancelled.
            raise dg.Failure(
                description=f"cancelled: {what}; the next run resumes the rest", allow_retries=False,
            ) from interrupt
    figures = {"model_load_seconds": round(load_seconds, 3), "inference_seconds": round(infer_seconds, 3)}
    computed = any(row["computed"] for row in rows)
    # No figures when nothing was computed: zeros would sit in the UI's plots beside real runs.
    return {"batches": len(rows), **(figures if computed else {}), "summary": _table(rows)}


# Declared without partitions, although batch_outputs is partitioned by date: Dagster 1.13 shows a
# partitioned check (a preview feature) three ways at once (the check list: its latest evaluation of
# any date, e.g. a green "Succeeded"; its pane: the selected date's, e.g. "Failed"; the lineage node:
# "0 / 1 Passed" counted over dates before any run). Unpartitioned, the list, the node and the pane
# all show the same latest evaluation, and its description starts with the date it judged.
FAILED_LINE_RATE = dg.AssetCheckSpec(
    "failed_line_rate",
    asset="batch_outputs",
    description=(
        "The latest date written: the share of failed lines over all of that date's batches stays under "
        "MAX_FAILED_LINE_RATE (default 10%); a warning names the date, the batches above it and why their lines failed."
    ),
)


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"python"},
    deps=[inference_results],
    check_specs=[FAILED_LINE_RATE],
    description="OpenAI-compatible output.jsonl, errors.jsonl and batch.json for each of the date's batches.",
)
def batch_outputs(
    context: dg.AssetExecutionContext, batch: BatchSelection, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    taken = run_batches(context, batch, storage)
    output_root = storage.settings().output_path
    rows = write_batches(context, taken, _shard(batch), output_root)
    if not taken:
        # Nothing left to do (e.g. after a file was re-run alone): the date's counts and check as its
        # files are now, so its pages read the same from this run on. A date without batches (or
        # results elsewhere: nothing to judge) gets no figures, so the plots show no zeros.
        date = [] if batch.output_uri else metrics.date_line_failures(output_root, context.partition_key)
        counts = {**date_line_counts(date), "batches_this_run": 0, "scope": f"every batch of {context.partition_key}"}
        return dg.MaterializeResult(metadata=counts if date else {"batches": 0},
                                    check_results=[failed_line_rate(context.partition_key, date)])
    failed = [r["batch"] for r in rows if r["status"] == "failed"]
    metadata = _summary(rows, "completed", "failed", "total")
    if failed:
        # The files are written either way; the run goes red so the failure is seen (and with it
        # the failed files' batch_files partitions, while the others of the date are green).
        raise dg.Failure(description=f"batch failed (file-level error): {', '.join(failed)}", metadata=metadata)
    table = results_table_metadata(rows)  # read once (from S3, a download)
    if _in_date_layout(taken, output_root):
        scope, judged = context.partition_key, metrics.date_line_failures(output_root, context.partition_key)
        metadata = {**date_line_counts(judged), "batches_this_run": len(rows), "this_run": metadata["summary"],
                    "scope": f"every batch of {context.partition_key}", **table}
    else:
        scope, judged = "this run's batches", [metrics.line_failures(row["output"]) for row in rows]
        metadata.update(table)
    return dg.MaterializeResult(metadata=metadata, check_results=[failed_line_rate(scope, judged)])


def write_batches(context: dg.AssetExecutionContext, taken: list[BatchLocation], shard: Shard, output_root: str,
                  report_files: bool = True) -> list[dict[str, Any]]:
    """Write each batch's results (a shard's only once every shard is done); one row per batch
    written. With `report_files`, each completed file in its date's folder gets its batch_files
    materialization."""
    rows = []
    for loc in taken:
        if not _assembled(loc, shard, merge=True):
            context.log.info(f"{loc.name}: shard {shard} is done; the last shard of the batch to finish writes its results")
            continue
        written = finalize_batch(loc, extra_metadata={"dagster_run_id": context.run.run_id})
        # metrics.json now, not only in throughput_metrics: a run that a failed file stops here
        # still leaves the figures of the files it answered, for the date's totals.
        metrics.batch_metrics(loc)
        counts = written["request_counts"]
        context.log.info(
            f"{loc.name}: {written['status']}, {counts['completed']} completed, {counts['failed']} failed -> {loc.output_uri}"
        )
        if report_files and file_status.in_date_layout(loc, output_root):
            if written["status"] == "completed":
                file_status.completed(context, loc, written)
            elif written["status"] == "failed":
                file_status.failed(context, loc, written)
        rows.append({"batch": loc.name, "status": written["status"], **counts, "output": loc.output_uri})
    return rows


def results_table_metadata(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The results.parquet columns (Dagster's column schema: the results' own, then a table input's
    carried-through ones) and the first rows of the run's first batch, without their text."""
    if not rows:
        return {}
    uri = storage_join(rows[0]["output"], tables.RESULTS_NAME)
    schema, head = tables.read_head(uri)
    columns = dg.TableSchema(columns=[
        dg.TableColumn(f.name, str(f.type), constraints=dg.TableColumnConstraints(nullable=f.nullable)) for f in schema
    ])

    # The preview leaves out every column that can hold user text (answers, error messages quoting
    # values, a table input's own columns): Dagster events never carry prompt or completion text.
    shown = dg.TableSchema(columns=[c for c in columns.columns if c.name in PREVIEW_COLUMNS])
    return {
        "dagster/column_schema": columns,
        "results": dg.MetadataValue.path(uri),
        "results_preview": dg.MetadataValue.table(
            records=[dg.TableRecord({k: "" if row[k] is None else row[k] for k in PREVIEW_COLUMNS}) for row in head],
            schema=shown),
    }


PREVIEW_COLUMNS = ("line", "custom_id", "status", "finish_reason", "prompt_tokens", "completion_tokens", "error_code")


def date_line_counts(judged: list[dict[str, Any]]) -> dict[str, Any]:
    """batch_outputs' figures over a date's batches (metrics.line_failures of each)."""
    failed, total = sum(b["failed"] for b in judged), sum(b["total"] for b in judged)
    return {"batches": len(judged), "completed": total - failed, "failed": failed, "total": total}


def failed_line_rate(scope: str, batches: list[dict[str, Any]]) -> dg.AssetCheckResult:
    """Per-request failures are data: gated by rate (a warning), not by failing the run. `batches`:
    metrics.line_failures() of each batch judged (every batch of the date, whichever runs wrote it)."""
    limit = max_failed_line_rate_from_env()
    failed, total = sum(b["failed"] for b in batches), sum(b["total"] for b in batches)
    rate = failed / total if total else 0.0

    def why(b: dict[str, Any]) -> str:
        codes = dict(b["codes"])
        answering = b["failed"] - sum(codes.values())
        if answering > 0:
            codes["failed while answering"] = answering
        reasons = ", ".join(f"{code} {n}" for code, n in sorted(codes.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{b['batch']}: {b['failed']} of {b['total']} ({b['rate']:.1%}; {reasons}) -> {b['errors']}"

    over = sorted((b for b in batches if b["rate"] > limit), key=lambda b: -b["failed"])
    head = f"{scope}: {failed} of {total} lines failed ({rate:.1%}) in {len(batches)} batch(es)"
    if rate > limit:
        description = f"{head}, above the {limit:.0%} limit (MAX_FAILED_LINE_RATE). " + "; ".join(why(b) for b in over[:5])
    else:
        description = f"{head}; limit {limit:.0%}" + (f". Above it alone: {'; '.join(why(b) for b in over[:3])}" if over else "")
    table = "\n".join(["| batch | failed | total | rate | why |", "| --- | --- | --- | --- | --- |"] + [
        f"| {b['batch']} | {b['failed']} | {b['total']} | {b['rate']:.1%} | "
        f"{', '.join(f'{c} {n}' for c, n in sorted(b['codes'].items())) or '-'} |" for b in batches
    ])
    return dg.AssetCheckResult(
        check_name="failed_line_rate",
        passed=rate <= limit,
        severity=dg.AssetCheckSeverity.WARN,
        description=description,
        metadata={"failed_rate": round(rate, 4), "failed": failed, "total": total, "limit": limit,
                  "scope": scope, "batches": dg.MetadataValue.md(table)},
    )


@dg.asset(
    partitions_def=daily_partitions,
    group_name="batch",
    kinds={"python"},
    deps=[batch_outputs],
    description=(
        "Throughput of the date's batches, whichever runs answered them: requests/s, tokens/s, time split, "
        "peak memory. A date run with nothing left to do records them again as they are; a run that wrote no results "
        "elsewhere (or a shard before the last) records none: batches 0."
    ),
)
def throughput_metrics(
    context: dg.AssetExecutionContext, batch: BatchSelection, storage: StorageResource
) -> dg.MaterializeResult:
    shard = _shard(batch)
    taken = run_batches(context, batch, storage)
    output_root = storage.settings().output_path
    if not taken and not batch.output_uri:
        # Nothing left to do: the date's figures as they are (none for a date without batches).
        whole_date = metrics.date_metrics(output_root, context.partition_key)
        if whole_date:
            return dg.MaterializeResult(metadata=date_figures(output_root, context.partition_key, 0, whole_date))
    per_batch = [metrics.batch_metrics(loc) for loc in taken if _measured_here(loc, shard, context.run.run_id)]
    if not per_batch:
        return dg.MaterializeResult(metadata=metrics.aggregate_metrics(per_batch))
    if _in_date_layout(taken, output_root):
        return dg.MaterializeResult(metadata=date_figures(output_root, context.partition_key, len(per_batch)))
    # Results written elsewhere (an explicit output_uri, e.g. the CLI): this run's batches alone.
    return dg.MaterializeResult(metadata={**metrics.aggregate_metrics(per_batch), "batches_this_run": len(per_batch),
                                          "scope": "this run's batches (results outside the date's folder)"})


def date_figures(output_root: str, date: str, this_run: int,
                 per_batch: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """throughput_metrics of a date: every batch of it (earlier sensor runs for other files, a
    backfill, a re-run of one file), read from their metrics.json (`per_batch`, when already read);
    also written as one table, `<output>/<date>/metrics.parquet` (a row per batch), for pandas."""
    if per_batch is None:
        per_batch = metrics.date_metrics(output_root, date)
    table = storage_join(output_root, date, metrics.DATE_TABLE)
    if per_batch:
        tables.write_metrics_table(table, per_batch)
    return {
        **metrics.aggregate_metrics(per_batch),
        "batches_this_run": this_run,
        "metrics_table": dg.MetadataValue.path(table),
        "scope": f"every batch of {date} under {locations.default_output(output_root, date, '')}",
    }


BATCH_ASSETS = [validated_requests, inference_results, batch_outputs, throughput_metrics]

"""`batch_files`: one partition per batch file ("<date>/<name>"), its status, and a re-run of it alone.

The four batch assets run a whole date (backfills, the nightly schedule, the upload sensor), with one
model load for all of its files; every file they take shows here on its own (defs/file_status.py).
Materializing a partition of this asset answers that one file (validate, infer, write, measure, as
batch_job does) and then refreshes its date's figures, so a file fixed after a failure is re-run in
a few clicks without writing config.
"""

import functools

import dagster as dg

from batch_pipeline.defs import file_status
from batch_pipeline.defs.assets import (
    INFERENCE_RETRIES,
    FAILED_LINE_RATE,
    already_done,
    date_line_counts,
    answer_batches,
    date_figures,
    failed_line_rate,
    validate_batches,
    write_batches,
)
from batch_pipeline.defs.partitions import batch_file_partitions, daily_partitions, split_file_key
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
from batch_pipeline.io import locations
from batch_pipeline.steps import metrics
from batch_pipeline.io.shards import Shard
from batch_pipeline.io.storage import read_json


@dg.asset(
    partitions_def=batch_file_partitions,
    group_name="batch_files",
    kinds={"vllm"},
    pool="gpu",
    retry_policy=INFERENCE_RETRIES,
    description=(
        "Each batch file on its own, keyed <date>/<batch name>: green once its results are written (by its date's "
        "run, an upload sensor run or a re-run here); a file a run failed has an observation saying why (Events). "
        "Materialize a "
        "partition to re-run that one file. A re-run loads the model first, which is most of a small file's time "
        "(about 40 s with the bundled model on 2 CPU cores); the last re-run's model_load_seconds is on its page."
    ),
)
def batch_files(
    context: dg.AssetExecutionContext, batch: BatchSelection, llm: LLMResource, storage: StorageResource
) -> dg.MaterializeResult:
    if batch.input_uri or batch.input_uris or batch.output_uri or batch.shard:
        raise dg.Failure(description="batch_files takes its file from the partition key (<date>/<name>); leave the "
                         "batch resource's input_uri, input_uris, output_uri and shard blank", allow_retries=False)
    try:
        date, name = split_file_key(context.partition_key)
    except ValueError as e:
        raise dg.Failure(description=str(e), allow_retries=False) from None
    if not daily_partitions.has_partition_key(date):
        raise dg.Failure(description=f"{date} is outside the date partitions (from "
                         f"{daily_partitions.get_first_partition_key()}; PARTITIONS_START)", allow_retries=False)
    s = storage.settings()
    loc = locations.find_batch_file(s.input_path, s.output_path, date, name)
    if loc is None:
        raise dg.Failure(description=f"no batch file {name}.jsonl (or .json, .ndjson, .parquet, .csv) of {date} under "
                         f"{s.input_path} (in {date}/, or at the top uploaded that day): deleted or renamed?",
                         allow_retries=False)
    if batch.skip_completed and already_done(loc, functools.cache(llm.identity)):
        context.log.info(f"{loc.name}: already completed from this file version with this model; left as it is "
                         "(set the batch resource's skip_completed to false to answer it again)")
        return dg.MaterializeResult(metadata=file_status.file_metadata(loc, read_json(loc.out("batch.json"))))
    whole = Shard.parse("")
    validate_batches(context, [loc], llm, whole, image_column=batch.image_column)
    figures = answer_batches(context, [loc], llm, whole)
    [row] = write_batches(context, [loc], whole, s.output_path, report_files=False)
    refresh_date(context, s.output_path, date, name)
    written = read_json(loc.out("batch.json"))
    if row["status"] == "failed":
        why = file_status.failed(context, loc, written)
        raise dg.Failure(description=f"{name} of {date} failed ({why['reason']}): see {loc.out('errors.jsonl')}",
                         metadata=why, allow_retries=False)
    load = {"model_load_seconds": figures["model_load_seconds"]} if "model_load_seconds" in figures else {}
    return dg.MaterializeResult(metadata={**file_status.file_metadata(loc, written), **load})


def refresh_date(context: dg.AssetExecutionContext, output_root: str, date: str, name: str) -> None:
    """The re-run changed one file of `date`: its date's figures (throughput_metrics), its line-rate
    check and, when no file of the date is left failed, batch_outputs (a date made red by this
    file turns green) are recorded again over every batch of the date."""
    judged = metrics.date_line_failures(output_root, date)
    # Said on the date's pages: Dagster's banner "Run ... failed, and did not materialize this asset"
    # names the date's last run that planned these assets, which a re-run of one file is not.
    why = (f"recorded again after re-running {name} alone (run {context.run.run_id[:8]}): current, "
           f"superseding any earlier failed run of {date}")
    if not any(b["status"] == "failed" for b in judged):
        context.log_event(dg.AssetMaterialization(
            "batch_outputs", partition=date, description=f"every batch of {date}, {why}",
            metadata={**date_line_counts(judged), "scope": f"every batch of {date}", "rerun": name,
                      "recorded_by": why},
        ))
    check = failed_line_rate(date, judged)
    context.log_event(dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("batch_outputs"), check_name=FAILED_LINE_RATE.name, passed=check.passed,
        severity=check.severity, description=check.description, metadata=check.metadata,
    ))
    context.log_event(dg.AssetMaterialization(
        "throughput_metrics", partition=date, description=f"every batch of {date}, {why}",
        metadata={**date_figures(output_root, date, 1), "rerun": name, "recorded_by": why},
    ))

"""`batch_files`: one partition per batch file ("<date>/<name>"), the unit a run is launched for.

The upload sensor, the nightly schedule and backfills of this asset run one file per run
(`batch_file_job`): validate, infer, write, measure, as batch_job does for a whole date. A file that
cannot be answered fails its run with dg.Failure carrying its reason, error codes, first error lines
and errors.jsonl, so its partition and its run are red in the UI while the date's other files go on;
a file with some bad lines is green with its counts. On a warm engine (ENGINE_URL) a file run is a
light client and several answer side by side; in-process, each loads the model.

The date's own assets (batch_outputs with its check, throughput_metrics) are recorded again by
date_figures_sensor whenever a file run of the date finishes, so nobody launches a date run for
them. A date run (batch_job: the CLI, SHARDS=n) still reports every file it takes here
(defs/file_status.py).
"""

import functools

import dagster as dg

from batch_pipeline.defs import file_status
from batch_pipeline.defs.assets import (
    INFERENCE_RETRIES,
    already_done,
    answering_pool,
    answer_batches,
    validate_batches,
    write_batches,
)
from batch_pipeline.defs.partitions import batch_file_partitions, daily_partitions, split_file_key
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
from batch_pipeline.io import locations
from batch_pipeline.io.shards import Shard
from batch_pipeline.io.storage import read_json


@dg.asset(
    partitions_def=batch_file_partitions,
    group_name="batch_files",
    kinds={"vllm"},
    pool=answering_pool(),
    retry_policy=INFERENCE_RETRIES,
    description=(
        "Each batch file on its own, keyed <date>/<batch name>, one run per file (the upload sensor, the nightly "
        "schedule, a backfill of these partitions): green once its results are written; red when the file cannot be "
        "answered, with the reason (codes, first error lines, errors.jsonl) on its run's failure. Materialize a "
        "partition to re-run that one file; the date's batch_outputs and throughput_metrics follow on their own "
        "(date_figures_sensor). On a warm engine (ENGINE_URL) a run answers on the server; in-process it loads the "
        "model first (about 40 s with the bundled model on 2 CPU cores: model_load_seconds on its page)."
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
    written = read_json(loc.out("batch.json"))
    if row["status"] == "failed":
        why = file_status.failed(context, loc, written)
        raise dg.Failure(description=f"{name} of {date} failed ({why['reason']}): see {loc.out('errors.jsonl')}",
                         metadata=why, allow_retries=False)
    load = {"model_load_seconds": figures["model_load_seconds"]} if "model_load_seconds" in figures else {}
    return dg.MaterializeResult(metadata={**file_status.file_metadata(loc, written), **load,
                                          "date_assets": date_note(date)})


def date_note(date: str) -> str:
    """What a file run's page says of its date."""
    return (f"{date}'s batch_outputs and throughput_metrics are recorded again with this file by date_figures_sensor "
            "within about 20 s of this run's end (no run is launched for them)")

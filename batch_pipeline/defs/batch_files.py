"""`batch_files`: one partition per batch file ("<date>/<name>"), its status, and a re-run of it alone.

The four batch assets run a whole date (backfills, the nightly schedule, the upload sensor), with one
model load for all of its files; every file they take shows here on its own (defs/file_status.py).
Materializing a partition of this asset answers that one file (validate, infer, write, measure, as
batch_job does), so a file fixed after a failure is re-run in a few clicks without writing config.

It records that file only. The date's assets are recorded by runs of the date, which Dagster's
pages read as the date's story: a date's page shows a failure banner while the latest run that
planned the date failed, even under a later materialization from another run (AssetPartitionDetail
in Dagster's UI, `latestRunForPartition`, the latest ASSET_MATERIALIZATION_PLANNED event). So the
re-run says on its page how to record the date again: materialize the date, which takes only the
files not completed (none is answered twice, and no model loads when none is left).
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
        "Each batch file on its own, keyed <date>/<batch name>: green once its results are written (by its date's "
        "run, an upload sensor run or a re-run here). A file a date's run failed is not green; its reason (codes, "
        "first error lines, errors.jsonl) is an observation: 'View all historical events' on its page, or Events. "
        "Materialize a partition to re-run that one file. A re-run loads the model first, which is most of a small "
        "file's time (about 40 s with the bundled model on 2 CPU cores); each re-run's model_load_seconds is on its "
        "page. It records the file only: materialize its date afterwards (no model load when no file is left) to "
        "record the date's figures and clear its failure."
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
    """What the re-run's page says of its date: a one-file run plans only batch_files, so Dagster
    goes on showing the date's last date run (a failure banner if it failed) until the date runs."""
    return (f"{date}'s own assets show its last date run (and its failure, if it failed), not this file yet: "
            f"materialize {date} (asset group batch, or Jobs > batch_job) to record the date with it; that run takes "
            "only the files not completed and loads no model when none is left")

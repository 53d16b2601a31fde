"""`batch_upload_sensor`: one `batch_job` run for every new or changed batch file under STORAGE_INPUT_PATH.

What counts as new, which date a file runs as and the cursor live in `lib/uploads.py`. A file
version that a backfill, the nightly schedule or an earlier run already completed (its batch.json
says `completed` for the same ETag) starts no run. The run key `<uri>@<etag>` is the second guard:
Dagster never launches the same key twice for this sensor, so a lost or reset cursor re-requests
old files but starts no run for them. With SHARDS=n, each new file starts n runs, one per line
range (`<uri>@<etag>#shard-i-of-n`).
"""

from __future__ import annotations

import time

import dagster as dg

from batch_pipeline.defs.jobs import batch_job, batch_run_config
from batch_pipeline.defs.partitions import daily_partitions
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.lib import locations
from batch_pipeline.lib.settings import shards_from_env
from batch_pipeline.lib.storage import list_objects
from batch_pipeline.lib.uploads import (
    NewBatch,
    PartitionRange,
    UploadCursor,
    already_completed,
    find_new_batches,
    folder_prefix,
)

# The daemon checks sensors about every 5 s; 30 s keeps a large S3 listing (one LIST call per
# 1,000 keys) cheap while a new file still starts within half a minute. A constant, not an
# environment variable: decorator arguments are fixed when the definitions load.
SENSOR_INTERVAL_SECONDS = 30


def partition_range() -> PartitionRange:
    first = daily_partitions.get_first_partition_key()
    last = daily_partitions.get_last_partition_key()
    assert first and last, "daily_partitions has a start date and end_offset=1: never empty"
    return PartitionRange(first, last)


def run_requests(new: NewBatch, shards: int = 1) -> list[dg.RunRequest]:
    """One run for the file, or with SHARDS=n, one run per line-range shard (lib/shards.py): n runs
    that queue for the `gpu` pool like any other and, on Kubernetes, land on n GPU pods."""
    uri = new.info.uri
    tags = {"batch_pipeline/input_uri": uri, "batch_pipeline/batch_name": locations.batch_name(uri)}
    if shards == 1:
        return [dg.RunRequest(run_key=new.run_key, partition_key=new.partition,
                              run_config=batch_run_config(input_uri=uri), tags=tags)]
    return [
        dg.RunRequest(
            run_key=f"{new.run_key}#shard-{i}-of-{shards}",
            partition_key=new.partition,
            run_config=batch_run_config(input_uri=uri, shard=f"{i}/{shards}"),
            tags={**tags, "batch_pipeline/shard": f"{i}/{shards}"},
        )
        for i in range(1, shards + 1)
    ]


# Stopped until someone turns it on (UI: Automation, or `dagster sensor start batch_upload_sensor`):
# on a fresh instance it would otherwise start runs, and load the model, for every file already in
# the input folder the moment `make dev` comes up.
@dg.sensor(
    job=batch_job,
    minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Starts batch_job for every new or changed .jsonl/.json/.ndjson file under STORAGE_INPUT_PATH "
        "(<date>/<name>.jsonl runs as that date; <name>.jsonl as its upload date, UTC); a file version "
        "already completed (by a backfill or the nightly run) starts no run."
    ),
)
def batch_upload_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
    settings = storage.settings()
    root = settings.input_path
    output = folder_prefix(settings.output_path)
    # Results written under the input folder must never trigger runs of their own.
    exclude = output if output.startswith(folder_prefix(root)) else ""
    shards = shards_from_env()  # a bad SHARDS fails the tick, naming the variable
    cursor = UploadCursor.parse(context.cursor)
    objects = list_objects(root)
    found, new_cursor = find_new_batches(
        root, objects, cursor, time.time(), partition_range(), context.log.info, exclude=exclude
    )
    requests = []
    for new in found:
        if already_completed(new, settings.output_path):
            context.log.info(f"{new.info.uri} (etag {new.info.etag}) is already completed; no run")
            continue
        context.log.info(
            f"new batch file {new.info.uri} (etag {new.info.etag}) -> partition {new.partition}"
            + (f", {shards} shard runs" if shards > 1 else "")
        )
        requests.extend(run_requests(new, shards))
    return dg.SensorResult(
        run_requests=requests,
        skip_reason=None if requests else f"no new batch files under {root} ({len(objects)} objects listed)",
        cursor=new_cursor.dumps(),
    )

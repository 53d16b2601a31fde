"""`batch_upload_sensor`: one `batch_file_job` run per new or changed batch file under STORAGE_INPUT_PATH.

Two ways to find them (docs/TRIGGERS.md): listing (the top of the input folder and the date
folders of the last SENSOR_WINDOW_DAYS dates; io/uploads.py) or, for big buckets, draining the
SQS queue the bucket notifies on ObjectCreated (INPUT_QUEUE_URL; io/notifications.py). Either way
each new file version is one run of its batch_files partition `<date>/<name>` (run key
`<uri>@<etag>`), so a file that cannot be answered is its own red run and partition in the UI; with
SHARDS=n each file gets n line-range runs of batch_job `<uri>@<etag>#shard-i-of-n`. A version that a
backfill, the nightly schedule or an earlier run already completed (its batch.json says `completed`
for the same ETag) starts no run, and Dagster never launches one run key twice, so a lost cursor or
a message read twice starts nothing new. On a warm engine (ENGINE_URL) the runs are light clients
that answer side by side; in-process, each loads the model (docs/TRIGGERS.md).

What is already there when the sensor is turned on follows SENSOR_BACKLOG: `run` queues a run for
each of those files not yet completed, `skip` leaves them to backfills. No tick requests more than
SENSOR_MAX_RUNS_PER_TICK runs; the rest wait.
"""

from __future__ import annotations

import time

import dagster as dg

from batch_pipeline.config.settings import (
    ConfigError,
    SensorSettings,
    sensor_interval_from_env,
    sensor_run_priority_from_env,
    sensor_settings_from_env,
    shards_from_env,
)
from batch_pipeline.config.priority import priority_tags
from batch_pipeline.defs.jobs import ENGINE_TAG, batch_file_job, batch_job, batch_run_config, engine_tag
from batch_pipeline.defs.partitions import (
    batch_file_partitions,
    daily_partitions,
    file_key,
)
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.io import locations, notifications
from batch_pipeline.io.storage import ObjectInfo, describe
from batch_pipeline.io.uploads import (
    BASELINE_SLACK_SECONDS,
    NewBatch,
    PartitionRange,
    UploadCursor,
    already_completed,
    folder_prefix,
    list_inputs,
    partition_of,
    scan,
    version_id,
    watched,
    window_dates,
)

# The daemon checks sensors about every 5 s; the default 30 s keeps a large S3 listing (one LIST
# call per 1,000 keys) cheap while a new file still starts within half a minute. Read from
# SENSOR_INTERVAL_SECONDS when the definitions load (a decorator argument), like PARTITIONS_START.
SENSOR_INTERVAL_SECONDS = sensor_interval_from_env()
# Completion checks (one GET of a batch.json each) per tick, beyond the runs requested: a tick over
# thousands of finished files spreads its checks over several ticks instead of nearing Dagster's
# 60 s limit on a sensor evaluation.
CHECKS_PER_TICK = 200
# A queue tick stops receiving after this long; what is left waits for the next tick.
QUEUE_TICK_SECONDS = 20.0


def partition_range() -> PartitionRange:
    first = daily_partitions.get_first_partition_key()
    last = daily_partitions.get_last_partition_key()
    assert first and last, "daily_partitions has a start date and end_offset=1: never empty"
    return PartitionRange(first, last)


def file_tags(new: NewBatch) -> dict[str, str]:
    """What a file run's page says it is for: the file, its batch name and date, and the engine its
    answers go to (the run queue's limit per engine counts this tag: dagster.yaml)."""
    uri = new.info.uri
    return {"batch_pipeline/input_uri": uri, "batch_pipeline/batch_name": locations.batch_name(uri),
            "batch_pipeline/date": new.partition, ENGINE_TAG: engine_tag()}


def run_requests(new: NewBatch, shards: int = 1) -> list[dg.RunRequest]:
    """One run of batch_file_job for the file (its batch_files partition `<date>/<name>`: red or
    green on its own in the UI), or with SHARDS=n, n line-range runs (io/shards.py) of batch_job
    for its date, which queue for the `gpu` pool like any other and, on Kubernetes, land on n GPU pods."""
    uri = new.info.uri
    tags = file_tags(new)
    if shards == 1:
        return [dg.RunRequest(run_key=new.run_key, job_name=batch_file_job.name,
                              partition_key=file_key(new.partition, locations.batch_name(uri)),
                              run_config=batch_run_config(), tags=tags)]
    return [
        dg.RunRequest(
            run_key=f"{new.run_key}#shard-{i}-of-{shards}",
            job_name=batch_job.name,
            partition_key=new.partition,
            run_config=batch_run_config(input_uri=uri, shard=f"{i}/{shards}"),
            tags={**tags, "batch_pipeline/shard": f"{i}/{shards}"},
        )
        for i in range(1, shards + 1)
    ]


def requests_for(chosen: list[NewBatch], shards: int) -> list[dg.RunRequest]:
    """The tick's new files as runs: one per file (run key `<uri>@<etag>`); with SHARDS=n, n per file."""
    return [r for new in chosen for r in run_requests(new, shards)]


def file_partitions(chosen: list[NewBatch]) -> list[dg.AddDynamicPartitionsRequest]:
    """The batch_files partitions of the tick's new files, so each shows in the UI once it is queued
    (the daemon adds only keys not there yet)."""
    keys = list(dict.fromkeys(file_key(n.partition, locations.batch_name(n.info.uri)) for n in chosen))
    return [batch_file_partitions.build_add_request(keys)] if keys else []


def _description() -> str:
    try:
        how = sensor_settings_from_env().describe()
    except ConfigError as e:
        how = f"not configured: {e}"
    return (
        "Starts one batch_file_job run (its batch_files partition) for every new or changed .jsonl/.json/.ndjson/.parquet/.csv file under STORAGE_INPUT_PATH "
        "(<date>/<name>.jsonl runs as that date; <name>.jsonl as its upload date, UTC); a file version "
        f"already completed (by a backfill or the nightly run) starts no run. Now: every {SENSOR_INTERVAL_SECONDS} s "
        f"(SENSOR_INTERVAL_SECONDS), {how}."
    )


class _Budget:
    """Runs and completion checks one tick may still spend."""

    def __init__(self, runs: int) -> None:
        self.runs, self.checks = runs, CHECKS_PER_TICK

    def exhausted(self) -> bool:
        return self.runs <= 0 or self.checks <= 0


def _choose(new: NewBatch, output_root: str, shards: int, budget: _Budget, chosen: list[NewBatch],
            log: dg.DagsterLogManager) -> bool:
    """Add `new` to the tick's runs unless its version is completed already; False when the tick
    has no run left for it (it waits for the next tick)."""
    if budget.runs < shards:
        return False
    if already_completed(new, output_root):
        budget.checks -= 1
        log.info(f"{new.info.uri} (etag {new.info.etag}) is already completed; no run")
        return True
    log.info(
        f"new batch file {new.info.uri} (etag {new.info.etag}) -> partition {new.partition}"
        + (f", {shards} shard runs" if shards > 1 else "")
    )
    budget.runs -= shards
    chosen.append(new)
    return True


def _backlog(date: str, files: list[ObjectInfo], cursor: UploadCursor, output_root: str, shards: int,
             budget: _Budget, chosen: list[NewBatch], log: dg.DagsterLogManager) -> bool:
    """Runs for the files of `date` that were there when the sensor was turned on (SENSOR_BACKLOG=run),
    in URI order: one per file not completed, like a new upload's. False when the tick's budget ran
    out first: the cursor keeps the last file handled, and the next tick goes on after it."""
    after = cursor.backlog_after.get(date, "")
    before, runs = len(chosen), 0
    for info in sorted(files, key=lambda i: i.uri):
        if info.uri <= after:
            continue
        new = NewBatch(info, date)
        if any(c.run_key == new.run_key for c in chosen):
            continue  # a new upload of this tick already
        if budget.exhausted() or not _choose(new, output_root, shards, budget, chosen, log):
            if after:
                cursor.backlog_after[date] = after
            return False
        after = info.uri
    runs = len(chosen) - before
    cursor.backlog_after.pop(date, None)
    log.info(f"backlog of {date}: {len(files)} file(s) there when the sensor was turned on; "
             + (f"{runs} run(s) for those not completed (SENSOR_BACKLOG=run)" if runs else "all already completed; no run"))
    return True


def _listing_tick(context: dg.SensorEvaluationContext, root: str, output_root: str, exclude: str,
                  settings: SensorSettings, shards: int) -> dg.SensorResult:
    started = time.monotonic()
    cursor = UploadCursor.parse(context.cursor)
    partitions = partition_range()
    window = window_dates(partitions, settings.window_days)
    objects = list_inputs(root, window)
    listed_in = time.monotonic() - started
    result = scan(root, objects, cursor, time.time(), partitions, context.log.info,
                  exclude=exclude, window=window, backlog_policy=settings.backlog)
    new_cursor = result.cursor
    budget = _Budget(settings.max_runs_per_tick)
    chosen: list[NewBatch] = []
    deferred: list[NewBatch] = []
    for new in result.found:
        if deferred or budget.checks <= 0 or not _choose(new, output_root, shards, budget, chosen, context.log):
            deferred.append(new)  # in upload order: once one waits, the later ones wait too
    new_cursor.defer(deferred)
    pending = []
    for date in new_cursor.backlog:
        if budget.exhausted() or not _backlog(date, result.backlog.get(date, []), new_cursor, output_root, shards,
                                              budget, chosen, context.log):
            pending.append(date)  # what its files still need waits for the next tick
    requests = requests_for(chosen, shards)
    new_cursor.backlog = pending
    waiting = len(deferred) + len(pending)
    summary = (f"listed {result.listed} objects ({len(window) if window is not None else 'all'} date folder(s) "
               f"and the top of {root}) in {listed_in:.1f}s; {len(requests)} run request(s)"
               + (f"; {len(deferred)} new file(s) and {len(pending)} backlog date(s) wait for the next tick "
                  f"(SENSOR_MAX_RUNS_PER_TICK={settings.max_runs_per_tick})" if waiting else ""))
    context.log.info(summary)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=file_partitions(chosen),
        skip_reason=None if requests else f"no new batch files under {root} ({result.listed} objects listed)",
        cursor=new_cursor.dumps(),
    )


def _queue_tick(context: dg.SensorEvaluationContext, root: str, output_root: str, exclude: str,
                settings: SensorSettings, shards: int) -> dg.SensorResult:
    url = settings.queue_url
    cursor = UploadCursor.parse(context.cursor)
    if cursor.delete:
        failed = notifications.delete(url, cursor.delete)
        context.log.info(f"deleted {len(cursor.delete) - len(failed)} message(s) the last tick handled"
                         + (f"; SQS refused {len(failed)} (they come back and are deduplicated): {failed[:3]}" if failed else ""))
    since = time.time() if cursor.fresh else cursor.since
    prefix = folder_prefix(root)
    partitions = partition_range()
    budget = _Budget(settings.max_runs_per_tick)
    chosen: list[NewBatch] = []
    handled: list[str] = []
    asked: set[str] = set()
    received = 0
    full = False  # a message that needs a run this tick does not have: it and the rest wait
    deadline = time.monotonic() + QUEUE_TICK_SECONDS
    while not full and budget.checks > 0 and time.monotonic() < deadline:
        messages = notifications.receive(url, settings.queue_visibility_seconds)
        if not messages:
            break
        received += len(messages)
        for i, message in enumerate(messages):
            created, why = notifications.created_objects(message.body)
            if why:
                context.log.info(f"ignoring message {message.id}: {why}")
            news = [n for obj in created if (n := _queue_object(context, obj.uri, prefix, exclude, partitions,
                                                                  settings, since, asked)) is not None]
            taken = [n for n in news if n.run_key not in {c.run_key for c in chosen}]
            if taken and not all(_choose(n, output_root, shards, budget, chosen, context.log) for n in taken):
                full = True
            if full or budget.checks <= 0:
                # Not handled: its files are not all in this tick's runs. It comes back at once.
                chosen = [c for c in chosen if c not in taken]
                notifications.release(url, [m.receipt for m in messages[i:]])
                break
            handled.append(message.receipt)
    requests = requests_for(chosen, shards)
    context.log.info(f"received {received} message(s) from {url}; {len(requests)} run request(s)"
                     + ("; more wait for the next tick" if full else ""))
    new_cursor = UploadCursor(since=since, delete=handled)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=file_partitions(chosen),
        skip_reason=None if requests else f"no new batch files in {url} ({received} message(s))",
        cursor=new_cursor.dumps(),
    )


def _queue_object(context: dg.SensorEvaluationContext, uri: str, prefix: str, exclude: str,
                  partitions: PartitionRange, settings: SensorSettings, since: float,
                  asked: set[str]) -> NewBatch | None:
    """The new file version an ObjectCreated event names, or None (not a batch file, gone, outside
    the partitions, backlog to skip, or already asked for in this tick)."""
    relative = watched(uri, prefix, exclude)
    if not relative:
        context.log.debug(f"ignoring {uri}: not a batch file under {prefix}")
        return None
    try:
        info = describe(uri)  # the version there now (a newer one than the event's is fine)
    except FileNotFoundError:
        context.log.info(f"ignoring {uri}: deleted since it was uploaded")
        return None
    partition, reason = partition_of(relative, info, partitions)
    if partition is None:
        context.log.info(f"ignoring {uri}: {reason}")
        return None
    # S3 times are whole seconds: a file uploaded in the same second as the first tick, just after
    # it, must not count as older; the margin runs a file uploaded just before instead.
    if settings.backlog == "skip" and info.modified < since - BASELINE_SLACK_SECONDS:
        context.log.info(f"ignoring {uri}: uploaded before the sensor was turned on (SENSOR_BACKLOG=skip)")
        return None
    new = NewBatch(info, partition, version_id(relative, info.etag))
    if new.run_key in asked:
        return None
    asked.add(new.run_key)
    return new


# Stopped until someone turns it on (UI: Automation, or `dagster sensor start batch_upload_sensor`):
# on a fresh instance it would otherwise start runs, and load the model, for every file already in
# the input folder the moment `make dev` comes up.
@dg.sensor(
    jobs=[batch_file_job, batch_job],
    minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=_description(),
)
def batch_upload_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
    paths = storage.settings()
    root = paths.input_path
    output = folder_prefix(paths.output_path)
    # Results written under the input folder must never trigger runs of their own.
    exclude = output if output.startswith(folder_prefix(root)) else ""
    shards = shards_from_env()  # a bad SHARDS fails the tick, naming the variable
    settings = sensor_settings_from_env()  # so does a bad SENSOR_* / INPUT_QUEUE_* value
    priority = sensor_run_priority_from_env()  # and a bad SENSOR_RUN_PRIORITY
    if settings.queue_url:
        if not root.startswith("s3://"):
            raise ConfigError(f"INPUT_QUEUE_URL is set but STORAGE_INPUT_PATH={root} is not on S3: only a bucket "
                              "sends ObjectCreated events; unset INPUT_QUEUE_URL to list the folder")
        result = _queue_tick(context, root, paths.output_path, exclude, settings, shards)
    else:
        result = _listing_tick(context, root, paths.output_path, exclude, settings, shards)
    if not priority:
        return result  # Dagster's queue reads a run without the tag as priority 0
    # Every run the tick asks for, on the Batch API's priority scale (defs/jobs.py).
    tags = priority_tags(priority)
    return dg.SensorResult(
        run_requests=[r.with_replaced_attrs(tags={**r.tags, **tags}) for r in result.run_requests or []],
        dynamic_partitions_requests=result.dynamic_partitions_requests,
        skip_reason=result.skip_reason,
        cursor=result.cursor,
    )


def window_file_keys(root: str, exclude: str, window_days: int | None) -> list[str]:
    """The batch_files partitions of the files a listing tick looks at (the top of the input folder and
    the window's date folders), in URI order; files that cannot be a partition are left out."""
    partitions = partition_range()
    prefix = folder_prefix(root)
    keys = []
    for info in sorted(list_inputs(root, window_dates(partitions, window_days)), key=lambda i: i.uri):
        relative = watched(info.uri, prefix, exclude)
        if not relative:
            continue
        date, _ = partition_of(relative, info, partitions)
        if date is not None:
            keys.append(file_key(date, locations.batch_name(info.uri)))
    return list(dict.fromkeys(keys))


# Running by default, unlike the upload sensor: it launches nothing, it only makes each file there
# is a batch_files partition, so a user can backfill or re-run files from the UI (Jobs >
# batch_file_job, or the asset's Partitions tab) before any run has seen them.
@dg.sensor(
    minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Adds a batch_files partition (<date>/<name>) for each batch file under STORAGE_INPUT_PATH (the top, and the "
        "date folders of the last SENSOR_WINDOW_DAYS dates), so files can be backfilled from the UI as one run each. "
        f"Launches no run; every {SENSOR_INTERVAL_SECONDS} s."
    ),
)
def file_partitions_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
    paths = storage.settings()
    root = paths.input_path
    output = folder_prefix(paths.output_path)
    exclude = output if output.startswith(folder_prefix(root)) else ""
    settings = sensor_settings_from_env()
    keys = window_file_keys(root, exclude, settings.window_days)
    if not keys:
        return dg.SensorResult(skip_reason=f"no batch files under {root} (the top, and the last "
                               f"{settings.window_days or 'all'} date folders)")
    known = set(context.instance.get_dynamic_partitions(batch_file_partitions.name))
    new = [k for k in keys if k not in known]
    if not new:
        return dg.SensorResult(skip_reason=f"{len(keys)} batch file(s) under {root}, each a batch_files partition already")
    context.log.info(f"{len(new)} new batch_files partition(s): {', '.join(new[:10])}" + (" ..." if len(new) > 10 else ""))
    return dg.SensorResult(dynamic_partitions_requests=[batch_file_partitions.build_add_request(new)])

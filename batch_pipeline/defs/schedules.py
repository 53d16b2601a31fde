"""`nightly_batch_schedule`: every night, one run per batch file of yesterday not yet completed.

Yesterday's files are those of its partition (`io/locations.partition_inputs`): the `<input>/<date>/`
folder plus the files directly under the input folder uploaded that day (UTC). Each becomes a
`batch_file_job` run of its batch_files partition `<date>/<name>` (red or green on its own). Files
that batch_upload_sensor (or an earlier run) already completed from the same version start no
run; a date without files, or with every file completed, starts none and says so on the tick.
"""

from __future__ import annotations

import datetime as dt

import dagster as dg
from dagster._utils.schedules import is_valid_cron_string  # what ScheduleDefinition takes

from batch_pipeline.base.env import read_checked
from batch_pipeline.config.settings import ConfigError, schedule_run_priority_from_env
from batch_pipeline.config.priority import priority_tags
from batch_pipeline.defs.jobs import ENGINE_TAG, batch_file_job, batch_run_config, engine_tag, model_versions_now
from batch_pipeline.defs.partitions import batch_file_partitions, daily_partitions, file_key
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.io import locations
from batch_pipeline.io.uploads import completed

# 02:00 UTC leaves two hours for late uploads of the day before. NIGHTLY_CRON overrides it; it is
# read when the definitions load (the cron is part of them, shown in the UI), never at import.
NIGHTLY_CRON = "0 2 * * *"
CRON = "a valid cron expression (five fields: minute hour day month weekday, e.g. '0 2 * * *')"


def nightly_cron_from_env(env: dict[str, str] | None = None) -> str:
    """NIGHTLY_CRON, or 02:00 UTC; ConfigError naming the variable and the value when Dagster would not
    take it as a schedule's cron (seconds, six fields, a 30th of February)."""
    return read_checked(env, "NIGHTLY_CRON", is_valid_cron_string, CRON, default=NIGHTLY_CRON)


def previous_day(scheduled: dt.datetime) -> str:
    """The UTC date before the tick: the partition a nightly tick runs."""
    return (scheduled.astimezone(dt.timezone.utc) - dt.timedelta(days=1)).date().isoformat()


def nightly_schedule_for(cron: str = NIGHTLY_CRON) -> dg.ScheduleDefinition:
    """The nightly schedule on a given cron (checked by Dagster; a bad NIGHTLY_CRON names itself)."""
    try:
        return _nightly_schedule(cron)
    except dg.DagsterInvalidDefinitionError as e:
        raise ConfigError(f"NIGHTLY_CRON={cron!r} is not {CRON}: {e}") from None


def _nightly_schedule(cron: str) -> dg.ScheduleDefinition:
    # Not build_schedule_from_partitioned_job: with end_offset=1 the partitions' last key is *today*,
    # which is what that helper would run; a nightly run wants the finished day. Stopped by default,
    # like batch_upload_sensor: turned on in the UI (Automation) or `dagster schedule start`.
    @dg.schedule(
        name="nightly_batch_schedule",
        cron_schedule=cron,
        job=batch_file_job,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=f"At {cron} (UTC), one batch_file_job run per batch file of yesterday not yet completed.",
    )
    def nightly_batch_schedule(context: dg.ScheduleEvaluationContext,
                               storage: StorageResource) -> list[dg.RunRequest] | dg.SkipReason:
        scheduled = context.scheduled_execution_time or dt.datetime.now(dt.timezone.utc)
        requests = nightly_requests(previous_day(scheduled), storage)
        if requests and not isinstance(requests, dg.SkipReason):
            add_file_partitions(context, [r.partition_key for r in requests])  # before the runs need them
        return requests

    return nightly_batch_schedule


def nightly_requests(day: str, storage: StorageResource) -> list[dg.RunRequest] | dg.SkipReason:
    """A batch_file_job run for each batch file of `day` not yet completed, or why there is none."""
    if not daily_partitions.has_partition_key(day):
        return dg.SkipReason(f"{day} is outside the partitions (from {daily_partitions.get_first_partition_key()})")
    # Read at each evaluation, so a bad value fails the tick naming the variable, not the code location.
    priority = schedule_run_priority_from_env()
    paths = storage.settings()
    files = locations.partition_inputs(paths.input_path, day)
    # Two files of one name (x.jsonl and x.csv) would write one folder: the run of that name says so.
    by_name = {locations.batch_name(info.uri): info for info in sorted(files, key=lambda i: i.uri)}
    todo = {name: info for name, info in by_name.items() if not completed(info, day, paths.output_path)}
    if not todo:
        return dg.SkipReason(f"{day}: {len(by_name)} batch file(s) under {paths.input_path}, "
                             + ("all already completed" if by_name else "none") + "; no run")
    # MODELS_FILE's versioned models as their aliases name them at this tick (none: no run config).
    versions = model_versions_now()
    tags = {ENGINE_TAG: engine_tag(), "batch_pipeline/date": day, **(priority_tags(priority) if priority else {})}
    return [dg.RunRequest(run_key=f"nightly-{file_key(day, name)}@{info.etag}", partition_key=file_key(day, name),
                          run_config=batch_run_config(model_versions=versions) if versions else None,
                          tags={**tags, "batch_pipeline/input_uri": info.uri, "batch_pipeline/batch_name": name})
            for name, info in todo.items()]


def add_file_partitions(context: dg.ScheduleEvaluationContext, keys: list[str]) -> None:
    """Add the batch_files partitions of a tick's runs (a schedule, unlike a sensor, cannot return them).
    Through an instance of its own from the tick's reference, closed at once: `context.instance` on a
    schedule with resources is opened on a context that nothing closes."""
    if context.instance_ref is None:
        raise dg.DagsterInvariantViolationError("nightly_batch_schedule needs an instance to add its files' partitions")
    instance = dg.DagsterInstance.from_ref(context.instance_ref)
    try:
        instance.add_dynamic_partitions(batch_file_partitions.name, keys)
    finally:
        instance.dispose()


@dg.definitions
def schedules() -> dg.Definitions:
    return dg.Definitions(schedules=[nightly_schedule_for(nightly_cron_from_env())])

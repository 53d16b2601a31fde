"""`nightly_batch_schedule`: every night, run yesterday's partition (all of that date's batch files).

The run has blank config, so it takes every file of the date (`io/locations.resolve_batches`): the
`<input>/<date>/` folder plus the files directly under the input folder uploaded that day (UTC).
Files that batch_upload_sensor (or an earlier run) already completed are left as they are. A date without
files finishes in seconds: no step loads the model when there is nothing to answer.
"""

from __future__ import annotations

import datetime as dt
import os

import dagster as dg

from batch_pipeline.config.settings import ConfigError, schedule_run_priority_from_env
from batch_pipeline.config.priority import priority_tags
from batch_pipeline.defs.jobs import batch_job, batch_run_config, model_versions_now
from batch_pipeline.defs.partitions import daily_partitions

# 02:00 UTC leaves two hours for late uploads of the day before. NIGHTLY_CRON overrides it; it is
# read when the definitions load (the cron is part of them, shown in the UI), never at import.
NIGHTLY_CRON = "0 2 * * *"


def previous_day(scheduled: dt.datetime) -> str:
    """The UTC date before the tick: the partition a nightly tick runs."""
    return (scheduled.astimezone(dt.timezone.utc) - dt.timedelta(days=1)).date().isoformat()


def nightly_schedule_for(cron: str = NIGHTLY_CRON) -> dg.ScheduleDefinition:
    """The nightly schedule on a given cron (checked by Dagster; a bad NIGHTLY_CRON names itself)."""
    try:
        return _nightly_schedule(cron)
    except dg.DagsterInvalidDefinitionError as e:
        raise ConfigError(f"NIGHTLY_CRON={cron!r} is not a valid cron expression (e.g. '0 2 * * *'): {e}") from None


def _nightly_schedule(cron: str) -> dg.ScheduleDefinition:
    # Not build_schedule_from_partitioned_job: with end_offset=1 the partitions' last key is *today*,
    # which is what that helper would run; a nightly run wants the finished day. Stopped by default,
    # like batch_upload_sensor: turned on in the UI (Automation) or `dagster schedule start`.
    @dg.schedule(
        name="nightly_batch_schedule",
        cron_schedule=cron,
        job=batch_job,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description=f"At {cron} (UTC), runs batch_job for yesterday's partition: every batch file of that date.",
    )
    def nightly_batch_schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        scheduled = context.scheduled_execution_time or dt.datetime.now(dt.timezone.utc)
        day = previous_day(scheduled)
        if not daily_partitions.has_partition_key(day):
            return dg.SkipReason(f"{day} is outside the partitions (from {daily_partitions.get_first_partition_key()})")
        # Read at each evaluation, so a bad value fails the tick naming the variable, not the code location.
        priority = schedule_run_priority_from_env()
        # MODELS_FILE's versioned models as their aliases name them at this tick (none: no run config).
        versions = model_versions_now()
        return dg.RunRequest(run_key=f"nightly-{day}", partition_key=day,
                             run_config=batch_run_config(model_versions=versions) if versions else None,
                             tags=priority_tags(priority) if priority else None)  # no tag: 0

    return nightly_batch_schedule


@dg.definitions
def schedules() -> dg.Definitions:
    return dg.Definitions(schedules=[nightly_schedule_for(os.environ.get("NIGHTLY_CRON", "").strip() or NIGHTLY_CRON)])

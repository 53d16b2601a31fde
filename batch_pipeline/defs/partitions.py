"""Batches are partitioned by the date they belong to (UTC), from PARTITIONS_START to today."""

import datetime as dt

import dagster as dg

from batch_pipeline.base.env import read_text
from batch_pipeline.config.settings import ConfigError

# A recent date, so that the UI's "missing" partitions mean dates that could have had files; set
# PARTITIONS_START to the first date you have batch files for (read when the definitions load).
DEFAULT_PARTITIONS_START = "2026-11-01"


def partitions_start(env: dict[str, str] | None = None) -> str:
    """PARTITIONS_START (YYYY-MM-DD, not after today, UTC), or the default."""
    raw = read_text(env, "PARTITIONS_START", DEFAULT_PARTITIONS_START)
    try:
        if len(raw) != 10:
            raise ValueError("not YYYY-MM-DD")
        day = dt.date.fromisoformat(raw)
    except ValueError:
        raise ConfigError(f"PARTITIONS_START={raw!r} is not a date (YYYY-MM-DD)") from None
    today = dt.datetime.now(dt.timezone.utc).date()
    if day > today:
        raise ConfigError(f"PARTITIONS_START={raw!r} is after today ({today}): there would be no partition")
    return day.isoformat()


# end_offset=1 makes today's partition exist, so a file uploaded today can run today.
daily_partitions = dg.DailyPartitionsDefinition(start_date=partitions_start(), timezone="UTC", end_offset=1)


# One partition per batch file, keyed "<date>/<batch name>" (e.g. "2026-11-20/feedback"): each file's
# own status in the UI and a re-run of one file (the batch_files asset). Keys are added as files are
# found (the upload sensor, or the first step of any run that takes them); dates stay the partitions
# of the four batch assets, so backfills and the nightly schedule still select whole days.
batch_file_partitions = dg.DynamicPartitionsDefinition(name="batch_files")


def file_key(date: str, name: str) -> str:
    """The batch_files partition of batch `name` of `date`."""
    return f"{date}/{name}"


def split_file_key(key: str) -> tuple[str, str]:
    """(date, batch name) of a batch_files partition key; a ValueError naming the key otherwise."""
    date, _, name = key.partition("/")
    try:
        dt.date.fromisoformat(date)
    except ValueError:
        date = ""
    if not date or not name:
        raise ValueError(f"batch_files partition {key!r} is not <YYYY-MM-DD>/<batch name>")
    return date, name

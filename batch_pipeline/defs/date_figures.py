"""`date_figures_sensor`: a date's results and figures follow its files' runs, with nobody launching anything.

A file is the unit a run is launched for (batch_files, `<date>/<name>`); a date's line counts
(batch_outputs, with its failed_line_rate check) and throughput (throughput_metrics, and the date's
metrics.parquet) are what its files' results add up to. When a file's run finishes, green or red,
this sensor records those two assets again for the file's date, read from the results every file
of the date has written (each file's metrics.json and output): a one-file re-run leaves the date's
row right. It records; it launches no run, so it costs no run slot and no run worker.

Each tick reads the runs finished since its cursor (their update time) and records each date whose
file runs are among them once. A date run (batch_job) records its date itself and is left alone.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
import dagster as dg

from batch_pipeline.defs.assets import FAILED_LINE_RATE, date_figures, date_line_counts, failed_line_rate
from batch_pipeline.defs.partitions import daily_partitions, split_file_key
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.steps import metrics

OUTPUTS = dg.AssetKey("batch_outputs")
THROUGHPUT = dg.AssetKey("throughput_metrics")
# A file run's results show in its date's row within this long (plus the daemon's own beat, ~5 s).
INTERVAL_SECONDS = 15
# Finished runs read per tick; more wait for the next tick (the cursor is where it stopped).
RUNS_PER_TICK = 1000
FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]


@dataclass
class FiguresCursor:
    """Where the last tick stopped: the update time of the last finished file run it took, and the
    runs finished at that very time (a later tick may see more of them)."""

    updated: float = 0.0
    runs: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: str | None) -> "FiguresCursor":
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(updated=float(data["t"]), runs=tuple(data.get("runs", ())))

    def dumps(self) -> str:
        return json.dumps({"t": self.updated, "runs": list(self.runs)})


@dataclass
class DateUpdate:
    """What one tick records: the dates' asset events, the next cursor, and what it read."""

    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation]
    cursor: FiguresCursor
    files: dict[str, list[str]]  # date -> the file partitions whose runs finished since the last tick


def files_finished(instance: dg.DagsterInstance, cursor: FiguresCursor) -> tuple[dict[str, list[str]], FiguresCursor]:
    """date -> the batch_files partitions whose runs finished (green, red or cancelled) since `cursor`,
    and the next cursor. Runs, not asset events: Dagster's open-source storages keep no event for a
    partition whose run failed (it is red from the run's status)."""
    since = dt.datetime.fromtimestamp(cursor.updated, tz=dt.timezone.utc) - dt.timedelta(microseconds=1)
    records = instance.get_run_records(
        filters=dg.RunsFilter(statuses=FINISHED, updated_after=since if cursor.updated else None),
        order_by="update_timestamp", ascending=True, limit=RUNS_PER_TICK)
    touched: dict[str, list[str]] = {}
    updated, at_last = cursor.updated, list(cursor.runs)
    for record in records:
        stamp = record.update_timestamp.timestamp()
        if stamp < cursor.updated or (stamp == cursor.updated and record.dagster_run.run_id in cursor.runs):
            continue  # taken by an earlier tick
        if stamp > updated:
            updated, at_last = stamp, []
        at_last.append(record.dagster_run.run_id)
        key = record.dagster_run.tags.get("dagster/partition", "")
        try:
            date, _ = split_file_key(key)
        except ValueError:
            continue  # not a file run (a date run records its date itself; API batches have no date)
        if daily_partitions.has_partition_key(date):
            keys = touched.setdefault(date, [])
            if key not in keys:
                keys.append(key)
    return touched, FiguresCursor(updated, tuple(at_last))


def date_events(output_root: str, date: str, files: list[str]) -> list[dg.AssetMaterialization | dg.AssetCheckEvaluation]:
    """batch_outputs and throughput_metrics of `date` as its files' results add up now, and the
    failed_line_rate check over them; nothing when the date has no results (no zeros in the plots)."""
    judged = metrics.date_line_failures(output_root, date)
    per_batch = metrics.date_metrics(output_root, date)
    if not judged and not per_batch:
        return []
    why = {"recorded_after": dg.MetadataValue.md(", ".join(files[:20]) + (f" ... ({len(files)} files)" if len(files) > 20 else "")),
           "recorded_by": "date_figures_sensor"}
    events: list[dg.AssetMaterialization | dg.AssetCheckEvaluation] = []
    if judged:
        events.append(dg.AssetMaterialization(
            asset_key=OUTPUTS, partition=date,
            description=f"{date}'s results as its files have written them (recorded after their runs)",
            metadata={**date_line_counts(judged), "scope": f"every batch of {date}", **why}))
        check = failed_line_rate(date, judged)
        events.append(dg.AssetCheckEvaluation(
            asset_key=OUTPUTS, check_name=FAILED_LINE_RATE.name, passed=check.passed, severity=check.severity,
            description=check.description, metadata=check.metadata))
    if per_batch:
        figures = date_figures(output_root, date, 0, per_batch)
        figures.pop("batches_this_run", None)
        events.append(dg.AssetMaterialization(
            asset_key=THROUGHPUT, partition=date,
            description=f"{date}'s throughput over every batch of the date (recorded after their runs)",
            metadata={**figures, **why}))
    return events


def update_dates(instance: dg.DagsterInstance, cursor: FiguresCursor, output_root: str) -> DateUpdate:
    """One tick: the dates whose files finished since `cursor`, recorded again."""
    touched, after = files_finished(instance, cursor)
    events = [event for date, files in sorted(touched.items()) for event in date_events(output_root, date, files)]
    return DateUpdate(events=events, cursor=after, files=touched)


@dg.sensor(
    minimum_interval_seconds=INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Records a date's batch_outputs (line counts, failed_line_rate) and throughput_metrics again when a run of one "
        f"of its files (batch_files) finishes, green or red; every {INTERVAL_SECONDS} s. Launches no run."
    ),
)
def date_figures_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
    cursor = FiguresCursor.parse(context.cursor)
    update = update_dates(context.instance, cursor, storage.settings().output_path)
    for date, files in sorted(update.files.items()):
        context.log.info(f"{date}: recorded after {len(files)} file run(s): {', '.join(files[:10])}")
    return dg.SensorResult(
        asset_events=update.events,
        cursor=update.cursor.dumps(),
        skip_reason=None if update.files else "no file run finished since the last tick",
    )


"""Each batch file's status in the UI: the batch_files partitions a date's run takes, answers and writes.

A run of the four date assets answers many files. So that each shows on its own (green, red, in
progress) in the batch_files asset, the run adds the files' partition keys, records that it plans
to materialize them when it takes them, and logs a materialization for each file it completes. A
file it does not complete (its file-level error fails the run, or the run dies) is then a planned
materialization of a failed run: Dagster's own definition of a failed partition, shown red.

Dagster has no public call to plan a materialization of an asset outside the run's selection: the
one event it needs is built with `dagster._core.events`, here and nowhere else, and
test_batch_files.py pins its behaviour, so a Dagster upgrade breaks that test, not the UI.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import dagster as dg

from batch_pipeline.defs.partitions import batch_file_partitions, file_key
from batch_pipeline.lib import locations
from batch_pipeline.lib.locations import BatchLocation

BATCH_FILES = dg.AssetKey("batch_files")


def in_date_layout(loc: BatchLocation, output_root: str) -> bool:
    """Whether the batch writes to its date's folder `<output>/<date>/<name>/`: the batches that have
    a batch_files partition (an explicit output_uri, e.g. the CLI's, has none)."""
    return loc.output_uri == locations.default_output(output_root, loc.partition, loc.name)


def key_of(loc: BatchLocation) -> str:
    return file_key(loc.partition, loc.name)


def register(instance: dg.DagsterInstance, keys: Iterable[str]) -> list[str]:
    """Add the batch_files partitions not there yet; returns those added. One look-up per key of the
    run (as the sensor daemon does), not a read of every file partition ever added."""
    new = [k for k in dict.fromkeys(keys) if not instance.has_dynamic_partition(batch_file_partitions.name, k)]
    if new:
        instance.add_dynamic_partitions(batch_file_partitions.name, new)
    return new


def plan(context: dg.AssetExecutionContext, locs: list[BatchLocation], output_root: str) -> None:
    """Register the run's files and mark them in progress (red if the run fails before completing them)."""
    from dagster._core.events import AssetMaterializationPlannedData, DagsterEvent

    mine = [loc for loc in locs if in_date_layout(loc, output_root)]
    register(context.instance, (key_of(loc) for loc in mine))
    step = context.get_step_execution_context().step.key
    for loc in mine:
        event = DagsterEvent.build_asset_materialization_planned_event(
            context.run.job_name, step, AssetMaterializationPlannedData(BATCH_FILES, partition=key_of(loc)),
        )
        context.instance.report_dagster_event(event, run_id=context.run.run_id)


def file_metadata(loc: BatchLocation, batch: dict[str, Any]) -> dict[str, Any]:
    """What a batch_files materialization shows: the file's Batch object in brief."""
    counts = batch["request_counts"]
    meta = batch.get("metadata") or {}
    return {
        "status": batch["status"],
        "completed": counts["completed"],
        "failed": counts["failed"],
        "total": counts["total"],
        "input_tokens": batch["usage"]["input_tokens"],
        "output_tokens": batch["usage"]["output_tokens"],
        "batch_id": batch["id"],
        "model": batch.get("model") or "",
        "input": dg.MetadataValue.path(loc.input_uri),
        "input_etag": meta.get("input_etag", ""),
        "results": dg.MetadataValue.path(loc.output_uri),
    }


def completed(context: dg.AssetExecutionContext, loc: BatchLocation, batch: dict[str, Any]) -> None:
    """Log the file's materialization (its batch_files partition turns green)."""
    context.log_event(dg.AssetMaterialization(BATCH_FILES, partition=key_of(loc), metadata=file_metadata(loc, batch),
                                              description=f"{loc.name} of {loc.partition}: {batch['status']}"))

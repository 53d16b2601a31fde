"""The batch job: the four batch assets (and their check) for one date, or for one file of it."""

from typing import Any

import dagster as dg

from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.batch_files import batch_files

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*BATCH_ASSETS),
    description="Validate, infer, write and measure the batch files of one date (or the one file in the run config).",
)

batch_file_job = dg.define_asset_job(
    "batch_file_job",
    selection=dg.AssetSelection.assets(batch_files),
    description="Re-run one batch file (a batch_files partition, <date>/<name>) alone: validate, infer, write, measure.",
)


# Run priority, one scale for every way a run starts (the Batch API's metadata.priority, the nightly
# schedule's SCHEDULE_RUN_PRIORITY, the upload sensor's SENSOR_RUN_PRIORITY): a whole number within
# +-PRIORITY_BOUND, higher starts first. Dagster's run queue (QueuedRunCoordinator) dequeues higher
# `dagster/priority` values first, and concurrency pools hand a free slot to the waiting step of the
# highest-priority run. The tag is priority x TURN_SPAN - turn: the Batch API gives each tenant's
# batch a turn among the batches of its priority, so tenants take turns; a triggered run has turn 0,
# ahead of every API batch of its priority still waiting its turn, behind any of a higher priority.
# Turns take TURN_SPAN values under one priority, so the tag stays within +-1e9: Dagster stores it in
# a 32-bit integer column (the pools' pending steps).
PRIORITY_TAG = "dagster/priority"
# The run's own priority and its turn, beside the composite dagster/priority, for people (and the API's turns).
BATCH_PRIORITY_TAG, TURN_TAG = "batch_pipeline/priority", "batch_pipeline/turn"
PRIORITY_BOUND = 1000
TURN_SPAN = 1_000_000


def priority_tags(priority: int, turn: int = 0) -> dict[str, str]:
    """The tags that place a run in Dagster's queue at `priority` (and `turn` among its equals)."""
    if not -PRIORITY_BOUND <= priority <= PRIORITY_BOUND or not 0 <= turn < TURN_SPAN:
        raise ValueError(f"priority {priority} (within +-{PRIORITY_BOUND}) and turn {turn} (0 to {TURN_SPAN - 1})")
    return {PRIORITY_TAG: str(priority * TURN_SPAN - turn), BATCH_PRIORITY_TAG: str(priority), TURN_TAG: str(turn)}


def batch_run_config(input_uri: str = "", output_uri: str = "", shard: str = "", skip_completed: bool = True,
                     input_uris: list[str] | None = None, endpoint: str = "", expires_at: int = 0) -> dict[str, Any]:
    """Run config of one run's batch selection (the `batch` resource every step reads): one input
    file/folder and one output folder, or several files of the date (`input_uris`), optionally one
    line range (`shard` "i/n") of each batch. All blank: every file of the partition's date.
    `endpoint` and `expires_at`: only lines of that url, and a deadline (the Batch API's)."""
    config: dict[str, Any] = {"input_uri": input_uri, "output_uri": output_uri}
    if input_uris:
        config["input_uris"] = list(input_uris)
    if shard:
        config["shard"] = shard
    if not skip_completed:
        config["skip_completed"] = False
    if endpoint:
        config["endpoint"] = endpoint
    if expires_at:
        config["expires_at"] = int(expires_at)
    return {"resources": {"batch": {"config": config}}}

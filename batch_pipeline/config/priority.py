"""Run priority: one scale for every way a run starts, and the tags that put a run on it.

The Batch API's `metadata["priority"]`, the nightly schedule's SCHEDULE_RUN_PRIORITY and the upload
sensor's SENSOR_RUN_PRIORITY are whole numbers within +-PRIORITY_BOUND, higher starts first. Dagster
does the queueing (docs/TRIGGERS.md, "Run priority"); this module only says what to tag.
"""

from __future__ import annotations

from collections.abc import Mapping

# Dagster's run queue (QueuedRunCoordinator) dequeues higher `dagster/priority` values first, and
# concurrency pools hand a free slot to the waiting step of the highest-priority run. The tag is
# priority x TURN_SPAN - turn: the Batch API gives each tenant's batch a turn among the batches of its
# priority, so tenants take turns; a triggered run has turn 0, ahead of every API batch of its priority
# still waiting its turn, behind any of a higher priority. Turns take TURN_SPAN values under one
# priority, so the tag stays within +-1e9: Dagster stores it in a 32-bit integer column (the pools'
# pending steps).
PRIORITY_BOUND = 1000
PRIORITY_TAG = "dagster/priority"
# The run's own priority and its turn, beside the composite dagster/priority, for people (and the API's turns).
BATCH_PRIORITY_TAG, TURN_TAG = "batch_pipeline/priority", "batch_pipeline/turn"
TURN_SPAN = 1_000_000


def priority_tags(priority: int, turn: int = 0) -> dict[str, str]:
    """The tags that place a run in Dagster's queue at `priority` (and `turn` among its equals)."""
    if not -PRIORITY_BOUND <= priority <= PRIORITY_BOUND or not 0 <= turn < TURN_SPAN:
        raise ValueError(f"priority {priority} (within +-{PRIORITY_BOUND}) and turn {turn} (0 to {TURN_SPAN - 1})")
    return {PRIORITY_TAG: str(priority * TURN_SPAN - turn), BATCH_PRIORITY_TAG: str(priority), TURN_TAG: str(turn)}


def run_priority(tags: Mapping[str, str]) -> int:
    """A run's own priority (higher sooner) from its tags; 0 for a run launched without one (the UI)."""
    try:
        return int(tags.get(BATCH_PRIORITY_TAG, "0"))
    except ValueError:  # a tag edited by hand into something else
        return 0

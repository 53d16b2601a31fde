"""A batch's status as OpenAI's Batch object: the pipeline's batch.json once written (with what the
batch cost in its metadata), else derived from the Dagster run carrying it and, while it runs, live
request counts from its checkpoints."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batch_pipeline.io import storage
from batch_pipeline.io.checkpoints import LineSet, iter_answers
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.service.batches.protocol import BatchObject, BatchRecord, RunFailure
from batch_pipeline.service.api_settings import COMPLETION_WINDOWS
from batch_pipeline.steps.metrics import COST_PREFIX

TERMINAL_STATUSES = ("completed", "failed", "cancelled", "expired")
# Dagster run status -> Batch status, while the pipeline has not written its Batch object.
RUN_STATUS = {"QUEUED": "validating", "NOT_STARTED": "validating", "STARTING": "validating", "STARTED": "in_progress",
              "CANCELING": "cancelling", "CANCELED": "cancelled", "FAILURE": "failed", "SUCCESS": "finalizing",
              # a failed run Dagster retries or may still retry (dagster_client.retry_outcome): not over
              "RETRYING": "in_progress"}
# What the Batch object takes from the pipeline's batch.json beside status and counts.
_FROM_PIPELINE = ("model", "usage", "errors", "in_progress_at", "finalizing_at", "completed_at", "failed_at",
                  "cancelling_at", "cancelled_at", "expired_at")

RunOf = Callable[[BatchRecord], tuple[str, str | None]]
WhyFailed = Callable[[str], str]  # a failed run's id -> why it failed and was not retried


def read_json(uri: str) -> dict[str, Any] | None:
    try:
        return storage.read_json(uri)
    except FileNotFoundError:
        return None


def pipeline_batch(record: BatchRecord) -> dict[str, Any] | None:
    """The Batch object the pipeline wrote for the batch (batch.json), None until it has."""
    return read_json(storage.join(record.output_uri, "batch.json"))


def batch_object(record: BatchRecord, run_of: RunOf, why_failed: WhyFailed | None = None) -> BatchObject:
    """The OpenAI Batch object of a service record: the pipeline's batch.json once written, else the
    status of the run `run_of(record)` reports ((run id, Dagster status or None when unknown)). A
    batch whose run failed for good says why (`why_failed(run id)`, asked once: kept in the record as
    `run_failure`). The object has the fields each case sets (`BatchObject.body`)."""
    pipeline = pipeline_batch(record)
    # The model versions the batch was pinned to at create (MODELS_FILE's versioned models), as the
    # SDK keeps metadata: a string.
    metadata = {**record.metadata, **({"model_versions": record.model_versions} if record.model_versions else {})}
    base: dict[str, Any] = {
        "id": record.id, "object": "batch", "endpoint": record.endpoint, "input_file_id": record.input_file_id,
        "completion_window": record.completion_window, "created_at": record.created_at,
        "expires_at": record.expires_at or record.created_at + COMPLETION_WINDOWS["24h"],
        "metadata": metadata, "errors": None,
        "output_file_id": None, "error_file_id": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
    }
    if pipeline is not None:
        return BatchObject.model_validate(_written(record, pipeline, base))
    if record.submit_error:
        return BatchObject.model_validate({**base, "status": "failed", "failed_at": record.created_at, "errors": {
            "object": "list", "data": [{"code": "not_queued", "message": "the run could not be submitted"}]}})
    return BatchObject.model_validate(_running(record, run_of, why_failed, base))


def _written(record: BatchRecord, pipeline: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The Batch object's fields once the pipeline wrote its own (batch.json, read as it is written)."""
    base.update({k: pipeline.get(k) for k in _FROM_PIPELINE})
    # The cost the pipeline recorded (cost_gpu_seconds, ...), beside the metadata the batch was made with.
    base["metadata"] = {**base["metadata"], **{k: v for k, v in (pipeline.get("metadata") or {}).items()
                                               if k.startswith(COST_PREFIX)}}
    base.update(status=pipeline["status"], request_counts=pipeline["request_counts"],
                output_file_id=f"file-{record.id}-output", error_file_id=f"file-{record.id}-errors")
    base["cancelling_at"] = base.get("cancelling_at") or record.cancelling_at
    return base


def _running(record: BatchRecord, run_of: RunOf, why_failed: WhyFailed | None, base: dict[str, Any]) -> dict[str, Any]:
    """The Batch object's fields from the run carrying the batch, while the pipeline has written none."""
    run_id, run_status = run_of(record)
    status = RUN_STATUS.get(run_status or "", "validating")
    counts = live_counts(record)
    if counts is not None:  # validated: the lines so far (answers as their checkpoints are written)
        base["request_counts"] = counts
        if status == "validating":
            status = "in_progress"
    if record.cancelling_at and status not in ("cancelled", "failed"):
        status = "cancelling"
    base["status"] = status
    if status == "cancelling":
        base["cancelling_at"] = record.cancelling_at
    if status == "failed":
        if why_failed is not None and (record.run_failure.run_id if record.run_failure else None) != run_id:
            record.run_failure = RunFailure(run_id=run_id, reason=why_failed(run_id), at=int(time.time()))
        failure = record.run_failure or RunFailure()
        base["failed_at"] = failure.at or int(time.time())
        reason = f": {failure.reason}" if failure.reason else "; see it in the UI"
        base["errors"] = {"object": "list", "data": [{"code": "run_failed", "message":
                          f"Dagster run {run_id} failed before writing results{reason}"}]}
    return base


def live_counts(record: BatchRecord) -> dict[str, int] | None:
    """request_counts of a batch still running: its lines, the bad ones, the answers checkpointed."""
    loc = BatchLocation(record.id, record.input_uri, record.output_uri, record.date)
    validation = read_json(loc.work("validation.json"))
    if validation is None:
        return None
    counts = {"total": validation["lines"], "completed": 0, "failed": validation["lines"] - validation["valid"]}
    inference = read_json(loc.work("inference.json"))
    if inference and inference.get("checkpoint_key"):
        seen = LineSet()
        for answer in iter_answers(loc, inference["checkpoint_key"]):
            if seen.add(answer["line"]):  # a line two overlapping attempts both wrote counts once
                counts["completed" if answer["kind"] == "output" else "failed"] += 1
    return counts

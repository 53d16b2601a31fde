"""Each batch file's status in the UI: the batch_files partitions a date's run takes, answers and writes.

A run of the four date assets answers many files. So that each shows on its own in the batch_files
asset, the run adds the files' partition keys when it takes them and, from the step that wrote each
file, records what became of it with Dagster's public events (`context.log_event`); Dagster stores
them with that run's id, so the file's page links the run and, for a named job, the job:
- a completed file: an `AssetMaterialization` of its partition (green), the Batch object in brief;
- a failed file (a file-level error, e.g. every line invalid): an `AssetObservation` of its
  partition saying why (the file-level error, the codes and their counts, the first error lines'
  numbers, the errors.jsonl path, the run and its job).

What Dagster 1.13.27 (the version pinned) does with these, read in its source:
- A partition is red ("failed") only when a run that planned it (an ASSET_MATERIALIZATION_PLANNED
  event, which Dagster writes for the assets and partition of the run's own selection) ended in
  failure with no materialization after it (storage/partition_status_cache.py,
  build_failed_and_in_progress_partition_subset). A date run plans the date's assets, never a
  batch_files partition, so a file failed by it is not red: it stays "missing". The event that
  would say so, ASSET_FAILED_TO_MATERIALIZE (AssetMaterializationFailure, not exported by
  `dagster`), is dropped by the open-source event storage (EventLogStorage.
  can_store_asset_failure_events is False; DagsterInstance.should_store_event).
- The partition page (AssetPartitionDetail.tsx in the UI) fills "Latest materialization", "Run",
  "Job" and "Metadata" from the latest materialization only, adding the observations newer than
  it; with none, it shows None and "No metadata entries", and the observation is one click away,
  under "View all historical events". A green failed file would put its reason there, at the cost
  of a green square for a failure, so it is not done.
- "Job" is left blank (None) for runs of Dagster's hidden `__ASSET_JOB`, which every launch from
  the asset graph is (execution/submit_asset_runs.py; the UI's getCommonJob picks it too), so the
  observation names the job itself; a run of batch_job (Jobs > batch_job, the sensor, the
  schedule) is named on the page.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import dagster as dg

from batch_pipeline.defs.partitions import batch_file_partitions, file_key
from batch_pipeline.io import locations, storage
from batch_pipeline.io.locations import BatchLocation

BATCH_FILES = dg.AssetKey("batch_files")
FIRST_ERROR_LINES = 5  # the first error lines' numbers shown on a failed file's page


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
    """Register the run's files (in the date layout) as batch_files partitions."""
    register(context.instance, (key_of(loc) for loc in locs if in_date_layout(loc, output_root)))


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


def failure_metadata(loc: BatchLocation, batch: dict[str, Any]) -> dict[str, Any]:
    """Why a file failed, for its page: the file-level error, each error code's count, the first
    error lines' numbers and where errors.jsonl is (read from the file's own validation record)."""
    try:
        validation = storage.read_json(loc.work("validation.json"))
    except FileNotFoundError:
        validation = {}
    first: list[int] = []
    try:
        with storage.open_read(loc.work("invalid.jsonl")) as lines:
            for raw in lines:
                if len(first) == FIRST_ERROR_LINES:
                    break
                first.append(int(json.loads(raw)["line"]))
    except FileNotFoundError:
        pass
    error = validation.get("file_error") or {}
    errors = (batch.get("errors") or {}).get("data") or []
    reason = error.get("message") or (errors[0].get("message") if errors else "") or "file-level error"
    counts = batch["request_counts"]
    return {
        "status": batch["status"],
        "reason": f"{error.get('code', 'failed')}: {reason}",
        "lines": validation.get("lines", counts["total"]),
        "invalid": validation.get("invalid", counts["failed"]),
        "error_codes": dg.MetadataValue.json(dict(validation.get("errors_by_code") or {})),
        "first_error_lines": ", ".join(str(n) for n in first) or "-",
        "errors": dg.MetadataValue.path(batch.get("error_file_id") or loc.out("errors.jsonl")),
        "input": dg.MetadataValue.path(loc.input_uri),
        "batch_id": batch["id"],
    }


def job_label(job_name: str) -> str:
    """A run's job as a user knows it: a launch from the asset graph runs as Dagster's hidden
    `__ASSET_JOB`, which the UI shows as no job."""
    if job_name.startswith("__ASSET_JOB"):
        return f"{job_name} (launched from the asset graph; Dagster's UI names no job for it)"
    return job_name


def completed(context: dg.AssetExecutionContext, loc: BatchLocation, batch: dict[str, Any]) -> None:
    """Log the file's materialization (its batch_files partition turns green)."""
    context.log_event(dg.AssetMaterialization(BATCH_FILES, partition=key_of(loc), metadata=file_metadata(loc, batch),
                                              description=f"{loc.name} of {loc.partition}: {batch['status']}"))


def failed(context: dg.AssetExecutionContext, loc: BatchLocation, batch: dict[str, Any]) -> dict[str, Any]:
    """Log why the file failed as an observation of its partition (its run and job among its
    metadata); returns that metadata."""
    metadata = {**failure_metadata(loc, batch), "run": dg.MetadataValue.dagster_run(context.run.run_id),
                "job": job_label(context.job_name)}
    context.log_event(dg.AssetObservation(BATCH_FILES, partition=key_of(loc), metadata=metadata,
                                          description=f"{loc.name} of {loc.partition} failed: {metadata['reason']}"))
    return metadata

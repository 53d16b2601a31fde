"""The Batch API's figures in Prometheus' text format (`GET /metrics`): no ids, no text; what finished
batches cost as counters by tenant and model; what the alert rules read (the oldest queued run's
age, the time to the next expiry, the lines of the upload sensor's and the schedule's batches).

What a scrape reads: the listing index's names, the records of batches not yet seen finished by this
process (a finished batch's Batch object is kept: `FinishedBatches`), and the two latest dates'
metrics.parquet when they changed (`DateLines`); not every record and batch.json.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from batch_pipeline.io import storage
from batch_pipeline.service.batches.protocol import BatchObject, BatchRecord
from batch_pipeline.service.status import TERMINAL_STATUSES
from batch_pipeline.service.store import Store
from batch_pipeline.steps.metrics import COST_FIELDS, DATE_TABLE, cost_of_metadata

log = logging.getLogger("batch_pipeline.service")

# Counters of what finished batches cost, by tenant and model: (metric, cost field, help).
COST_COUNTERS = (
    ("batch_pipeline_api_cost_batches_total", None, "Finished batches."),
    ("batch_pipeline_api_cost_gpu_seconds_total", "gpu_seconds",
     "GPU-seconds of finished batches: engine-seconds x the GPUs the run held (0 on the CPU)."),
    ("batch_pipeline_api_cost_engine_seconds_total", "engine_seconds",
     "Engine-seconds of finished batches: model load and answering, each batch's share."),
    ("batch_pipeline_api_cost_model_load_seconds_total", "model_load_seconds", "Model load seconds of finished batches."),
    ("batch_pipeline_api_cost_input_tokens_total", "input_tokens", "Input tokens of finished batches."),
    ("batch_pipeline_api_cost_output_tokens_total", "output_tokens", "Output tokens of finished batches."),
)
assert {field for _, field, _ in COST_COUNTERS if field} == set(COST_FIELDS) - {"gpus"}


def label(value: str) -> str:
    """A Prometheus label value, escaped (tenants and model names are free text)."""
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sum as Prometheus reads it, exact: 1234567, not 1.23457e+06."""
    return str(int(value)) if float(value).is_integer() else str(round(value, 3))


# What /metrics keeps of a Batch object.
_KEPT = ("status", "request_counts", "usage", "metadata", "model", "expires_at")


class FinishedBatches:
    """Every batch's Batch object for /metrics, each finished one read once per process.

    A batch the service has seen finished is over (its record leaves the open index then), so its
    figures are kept here by id: a scrape lists the ids (the listing index, no read) and reads only the
    batches not kept: those still open (their status can change) and those new since the last scrape.
    The first scrape after a start reads every batch once. (A batch cancelled and then re-run from the
    UI to completion keeps its first figures here until the service restarts.)"""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def batches(self, store: Store, batch_object: Callable[[BatchRecord], BatchObject],
                ids: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(tenant, Batch object) of every batch of every tenant (`ids`: the store's batch ids, if listed)."""
        found = []
        for batch_id in store.batch_ids() if ids is None else ids:
            kept = self._kept.get(batch_id)
            if kept is None:
                record = store.batch_by_id(batch_id)
                if record is None:  # a listing marker whose record was never written (a crashed create)
                    continue
                batch = batch_object(record)
                sent = batch.body()  # the fields the API answers, as it answers them
                kept = (record.tenant, {k: sent.get(k) for k in _KEPT})
                # Kept once over; but a batch failed by its run's status alone (no Batch object from
                # the pipeline) is read again, since a late retry can still take it up.
                if batch.status in TERMINAL_STATUSES and (batch.output_file_id or batch.status != "failed"):
                    with self._lock:
                        self._kept[batch_id] = kept
            found.append(kept)
        return found


class DateLines:
    """Lines of the upload sensor's and the schedule's batches (every batch in a date's folder but the
    Batch API's), answered and failed, from the date's metrics.parquet (a row per batch, written by
    each run's `throughput_metrics`), read again only when it changed (one describe a scrape)."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[str, list[tuple[str, int, int]]]] = {}  # uri -> (etag, rows)
        self._lock = threading.Lock()

    def lines(self, output_root: str, date: str, api_batches: set[str]) -> dict[str, int]:
        uri = storage.join(output_root, date, DATE_TABLE)
        try:
            etag = storage.describe(uri).etag
        except FileNotFoundError:
            return {"completed": 0, "failed": 0}
        kept = self._tables.get(uri)
        if kept is None or kept[0] != etag:
            import pyarrow.parquet as pq

            with storage.open_read(uri) as handle:
                table = pq.read_table(handle, columns=["batch", "requests_completed", "requests_failed"]).to_pydict()
            kept = (etag, list(zip(table["batch"], table["requests_completed"], table["requests_failed"], strict=True)))
            with self._lock:
                self._tables.pop(uri, None)
                self._tables[uri] = kept
                while len(self._tables) > 4:  # the two dates read, and the two before the date changed
                    self._tables.pop(next(iter(self._tables)))
        rows = [(c, f) for batch, c, f in kept[1] if batch not in api_batches]
        return {"completed": int(sum(c for c, _ in rows)), "failed": int(sum(f for _, f in rows))}


def recent_dates(now: float | None = None) -> list[str]:
    """Yesterday and today (UTC): the nightly schedule answers yesterday's date, the sensor today's."""
    today = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).date()
    return [(today - dt.timedelta(days=1)).isoformat(), today.isoformat()]


@dataclass
class Queue:
    """Dagster's run queue as /metrics shows it: runs waiting, and how long the oldest has waited."""

    runs: int
    oldest_age_seconds: float  # 0 with no run queued


# The queued runs' creation times, in one query: the daemon's queue coordinator reads the same list each tick.
QUEUE_QUERY = ("{ runsOrError(filter: {statuses: [QUEUED]}) { __typename ... on Runs { count results { creationTime } } "
               "... on PythonError { message } } }")


def read_queue(graphql: Callable[[str], dict[str, Any]], now: float | None = None) -> Queue | None:
    """Dagster's queue through the service's client (`DagsterClient.graphql`); None when it cannot be
    read (the figures are left out, not 0)."""
    try:
        runs = graphql(QUEUE_QUERY)["runsOrError"]
        if "results" not in runs:
            raise RuntimeError(str(runs.get("message"))[:200])
    except Exception as e:  # noqa: BLE001 - a figure left out, not an error of /metrics
        log.warning("run queue unknown (%s)", type(e).__name__)
        return None
    created = [float(r["creationTime"]) for r in runs["results"] if r.get("creationTime") is not None]
    now = time.time() if now is None else now
    return Queue(int(runs.get("count", len(created))), max(0.0, now - min(created)) if created else 0.0)


def prometheus(batches: Iterable[tuple[str, dict[str, Any]]], files: int, queued: int | Queue | None,
               file_lines: dict[str, dict[str, int]] | None = None, now: float | None = None) -> str:
    """Batches by status, lines and tokens of finished batches (over every tenant), and counters of
    what finished batches cost by tenant and model, from (tenant, Batch object) pairs; the seconds to
    the soonest `expires_at` of a batch not finished (left out with none); `files` uploaded files
    kept; `queued` runs waiting in Dagster's queue and the oldest one's age (left out, not 0, when None:
    the web server did not answer); `file_lines` {date: {"completed", "failed"}} of the upload
    sensor's and the schedule's batches."""
    by_status: dict[str, int] = {}
    lines = {"completed": 0, "failed": 0}
    tokens = {"input": 0, "output": 0}
    costs: dict[tuple[str, str], dict[str, float]] = {}
    next_expiry: float | None = None
    now = time.time() if now is None else now
    for tenant, batch in batches:
        by_status[batch["status"]] = by_status.get(batch["status"], 0) + 1
        if batch["status"] not in TERMINAL_STATUSES and batch.get("expires_at"):
            next_expiry = min(batch["expires_at"], next_expiry if next_expiry is not None else batch["expires_at"])
        if batch["status"] in TERMINAL_STATUSES and batch.get("usage"):
            lines["completed"] += batch["request_counts"]["completed"]
            lines["failed"] += batch["request_counts"]["failed"]
            tokens["input"] += batch["usage"].get("input_tokens", 0)
            tokens["output"] += batch["usage"].get("output_tokens", 0)
        cost = cost_of_metadata(batch.get("metadata")) if batch["status"] in TERMINAL_STATUSES else None
        if cost is not None:
            sums = costs.setdefault((tenant, str(batch.get("model") or "")), {"batches": 0.0})
            sums["batches"] += 1
            for name, value in cost.items():
                sums[name] = sums.get(name, 0.0) + value
    out = ["# HELP batch_pipeline_api_batches Batches of the Batch API by status.",
           "# TYPE batch_pipeline_api_batches gauge"]
    for status in sorted(set(by_status) | {"validating", "in_progress", "completed", "failed", "cancelled"}):
        out.append(f'batch_pipeline_api_batches{{status="{status}"}} {by_status.get(status, 0)}')
    out += ["# HELP batch_pipeline_api_lines Lines of finished batches, answered or failed.",
            "# TYPE batch_pipeline_api_lines gauge"]
    out += [f'batch_pipeline_api_lines{{result="{k}"}} {v}' for k, v in lines.items()]
    out += ["# HELP batch_pipeline_api_tokens Tokens of finished batches.", "# TYPE batch_pipeline_api_tokens gauge"]
    out += [f'batch_pipeline_api_tokens{{kind="{k}"}} {v}' for k, v in tokens.items()]
    out += ["# HELP batch_pipeline_api_files Uploaded files kept.", "# TYPE batch_pipeline_api_files gauge",
            f"batch_pipeline_api_files {files}"]
    for metric, field, text in COST_COUNTERS:
        out += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
        out += [f'{metric}{{tenant="{label(tenant)}",model="{label(model)}"}} {_number(sums[field or "batches"])}'
                for (tenant, model), sums in sorted(costs.items())]
    if next_expiry is not None:
        out += ["# HELP batch_pipeline_api_next_expiry_seconds Seconds until the soonest completion window of an "
                "unfinished batch ends (negative: past it, not yet seen expired); absent with none unfinished.",
                "# TYPE batch_pipeline_api_next_expiry_seconds gauge",
                f"batch_pipeline_api_next_expiry_seconds {_number(round(next_expiry - now, 3))}"]
    if file_lines is not None:
        out += ["# HELP batch_pipeline_file_lines Lines of the upload sensor's and the schedule's batches of a date "
                "(every batch in the date's folder but the Batch API's), answered or failed; yesterday and today.",
                "# TYPE batch_pipeline_file_lines gauge"]
        out += [f'batch_pipeline_file_lines{{date="{date}",result="{k}"}} {v}'
                for date, counts in sorted(file_lines.items()) for k, v in counts.items()]
    if queued is not None:
        queue = queued if isinstance(queued, Queue) else Queue(queued, 0.0)
        out += ["# HELP batch_pipeline_api_queued_runs Runs waiting in the Dagster instance's queue, of every job.",
                "# TYPE batch_pipeline_api_queued_runs gauge", f"batch_pipeline_api_queued_runs {queue.runs}",
                "# HELP batch_pipeline_api_oldest_queued_run_age_seconds How long the oldest run in the Dagster "
                "instance's queue has waited since it was created (0 with none queued).",
                "# TYPE batch_pipeline_api_oldest_queued_run_age_seconds gauge",
                f"batch_pipeline_api_oldest_queued_run_age_seconds {_number(round(queue.oldest_age_seconds, 3))}"]
    return "\n".join(out) + "\n"

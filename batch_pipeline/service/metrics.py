"""The Batch API's figures in Prometheus' text format (`GET /metrics`): no ids, no text; what finished
batches cost as counters by tenant and model.

What a scrape reads: the listing index's names and the records of batches not yet seen finished by
this process (a finished batch's Batch object is kept: `FinishedBatches`), not every record and
batch.json.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from batch_pipeline.service.status import TERMINAL_STATUSES
from batch_pipeline.service.store import Store
from batch_pipeline.steps.metrics import COST_FIELDS, cost_of_metadata

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

    def batches(self, store: Store, batch_object: Callable[[dict[str, Any]], dict[str, Any]],
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
                kept = (record["tenant"], {k: batch.get(k) for k in _KEPT})
                if batch["status"] in TERMINAL_STATUSES:
                    with self._lock:
                        self._kept[batch_id] = kept
            found.append(kept)
        return found


def prometheus(batches: Iterable[tuple[str, dict[str, Any]]], files: int, queued: int | None) -> str:
    """Batches by status, lines and tokens of finished batches (over every tenant), and counters of
    what finished batches cost by tenant and model, from (tenant, Batch object) pairs; `files`
    uploaded files kept; `queued` runs waiting in Dagster's queue (left out, not 0, when None: the web
    server did not answer)."""
    by_status: dict[str, int] = {}
    lines = {"completed": 0, "failed": 0}
    tokens = {"input": 0, "output": 0}
    costs: dict[tuple[str, str], dict[str, float]] = {}
    for tenant, batch in batches:
        by_status[batch["status"]] = by_status.get(batch["status"], 0) + 1
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
    if queued is not None:
        out += ["# HELP batch_pipeline_api_queued_runs Runs waiting in the Dagster instance's queue, of every job.",
                "# TYPE batch_pipeline_api_queued_runs gauge", f"batch_pipeline_api_queued_runs {queued}"]
    return "\n".join(out) + "\n"

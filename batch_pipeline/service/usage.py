"""What the Batch API's batches cost, per tenant and model (`batch-pipeline usage`).

Read from the records the service keeps (`_batch_api/batches/`, for each batch's tenant and creation
time) and the Batch object the pipeline wrote for each (`batch.json`, whose `cost_*` metadata holds
GPU-seconds, engine-seconds, model load seconds and tokens). A batch counts once it is finished;
one still queued or running, or whose run never wrote its results, is not in the figures.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
from typing import Any

from batch_pipeline.service.status import TERMINAL_STATUSES, pipeline_batch
from batch_pipeline.service.store import Store
from batch_pipeline.steps.metrics import COST_FIELDS, cost_of_metadata

COLUMNS = ("tenant", "model", "batches", "input_tokens", "output_tokens", "engine_seconds", "gpu_seconds",
           "model_load_seconds")


def usage_rows(store: Store, since: dt.date, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per (tenant, model) of the finished batches created on or after `since` (UTC), of
    `tenant` only when given: COLUMNS, sorted by tenant and model."""
    start = dt.datetime.combine(since, dt.time(), dt.timezone.utc).timestamp()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for record in store.all_batches():
        if record.created_at < start or (tenant is not None and record.tenant != tenant):
            continue
        batch = pipeline_batch(record)
        if batch is None or batch["status"] not in TERMINAL_STATUSES:
            continue
        usage = batch.get("usage") or {}
        cost = cost_of_metadata(batch.get("metadata")) or {  # a batch.json written before costs were recorded
            "input_tokens": usage.get("input_tokens", 0), "output_tokens": usage.get("output_tokens", 0)}
        row = rows.setdefault((record.tenant, str(batch.get("model") or "")), {
            "tenant": record.tenant, "model": str(batch.get("model") or ""), "batches": 0,
            **{name: 0 for name in COLUMNS[3:]}})
        row["batches"] += 1
        for name in COLUMNS[3:]:
            row[name] += cost.get(name, 0)
    for row in rows.values():
        for name in ("input_tokens", "output_tokens"):
            row[name] = int(row[name])
        for name in ("engine_seconds", "gpu_seconds", "model_load_seconds"):
            row[name] = round(float(row[name]), 3)
    return [rows[key] for key in sorted(rows)]


def as_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def as_table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text columns (numbers to the right)."""
    cells = [list(COLUMNS)] + [[str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    text = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in cells]
    return "\n".join(line.rstrip() for line in text) + "\n"


assert set(COLUMNS[3:]) == set(COST_FIELDS) - {"gpus"}

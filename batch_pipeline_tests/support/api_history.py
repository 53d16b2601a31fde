"""A Batch API store with a history: finished batches written as the service and the pipeline write them.

`write_history(output_root, n, tenants)` lays down `n` past batches under STORAGE_OUTPUT_PATH, each
with the service's record (`_batch_api/batches/<id>.json`), the pipeline's Batch object
(`<date>/<id>/batch.json`) and a small output.jsonl, so retrieve, list, content and /metrics read
them exactly as they read real ones. Written straight to files (the records' on-disk format, which
every replica of the service reads), not through the service, so 10,000 take seconds and no run.
Statuses cycle through the terminal ones; every 50th batch has failed lines.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUSES = ("completed", "completed", "completed", "failed", "cancelled", "expired")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def write_history(output_root: Path, n: int, tenants: list[str], model: str = "tiny",
                  now: float | None = None) -> list[dict[str, Any]]:
    """`n` finished batches of `tenants` (round robin), newest last; returns their records."""
    now = time.time() if now is None else now
    records = []
    for i in range(n):
        batch_id = f"batch_hist{i:019d}"
        tenant = tenants[i % len(tenants)]
        created = int(now) - (n - i) * 60
        date = time.strftime("%Y-%m-%d", time.gmtime(created))
        out = output_root / date / batch_id
        status = STATUSES[i % len(STATUSES)]
        total = 20
        failed = 2 if i % 50 == 0 else 0
        completed = total - failed if status in ("completed", "cancelled", "expired") else 0
        if status == "failed":
            failed = 0
        record = {"id": batch_id, "tenant": tenant, "input_file_id": f"file-hist{i:019d}",
                  "input_uri": str(output_root / "_batch_api" / "files" / f"file-hist{i:019d}.jsonl"),
                  "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"n": str(i)},
                  "priority": 0, "created_at": created, "expires_at": created + 86400, "date": date,
                  "output_uri": str(out), "run_id": f"run-hist-{i}", "output_expires_after": None, "turn": 0}
        batch = {"id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions", "status": status,
                 "model": model, "created_at": created, "in_progress_at": created + 5,
                 f"{status}_at": created + 30,
                 "request_counts": {"total": total if status != "failed" else 0, "completed": completed,
                                    "failed": failed},
                 "usage": {"input_tokens": 10 * completed, "output_tokens": 4 * completed,
                           "total_tokens": 14 * completed} if status != "failed" else None,
                 "errors": None}
        lines = "".join(json.dumps({"id": f"req-{i}-{j}", "custom_id": f"q{j}", "response": {
            "status_code": 200, "request_id": f"req-{i}-{j}", "body": {"object": "chat.completion"}},
            "error": None}) + "\n" for j in range(2))
        _write(output_root / "_batch_api" / "batches" / f"{batch_id}.json", json.dumps(record).encode())
        _write(out / "batch.json", json.dumps(batch).encode())
        _write(out / "output.jsonl", lines.encode())
        os.utime(out / "output.jsonl", (created + 30, created + 30))
        records.append(record)
    return records

"""The Batch API's figures in Prometheus' text format (`GET /metrics`): no ids, no text."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batch_pipeline.service.status import TERMINAL_STATUSES


def prometheus(batches: Iterable[dict[str, Any]], files: int, queued: int | None) -> str:
    """Batches by status, lines and tokens of finished batches (over every tenant), from the Batch
    objects `batches`; `files` uploaded files kept; `queued` runs waiting in Dagster's queue (left
    out, not 0, when None: the web server did not answer)."""
    by_status: dict[str, int] = {}
    lines = {"completed": 0, "failed": 0}
    tokens = {"input": 0, "output": 0}
    for batch in batches:
        by_status[batch["status"]] = by_status.get(batch["status"], 0) + 1
        if batch["status"] in TERMINAL_STATUSES and batch.get("usage"):
            lines["completed"] += batch["request_counts"]["completed"]
            lines["failed"] += batch["request_counts"]["failed"]
            tokens["input"] += batch["usage"].get("input_tokens", 0)
            tokens["output"] += batch["usage"].get("output_tokens", 0)
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
    if queued is not None:
        out += ["# HELP batch_pipeline_api_queued_runs Runs waiting in the Dagster instance's queue, of every job.",
                "# TYPE batch_pipeline_api_queued_runs gauge", f"batch_pipeline_api_queued_runs {queued}"]
    return "\n".join(out) + "\n"

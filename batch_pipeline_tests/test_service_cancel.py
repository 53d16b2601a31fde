"""Cancelling a batch whose run Dagster is still starting: `batch-pipeline serve` over a real `dagster
dev` (its daemon launching runs of the tiny model), driven by the openai SDK.

Covered: a cancel that arrives while the run is STARTING (which Dagster refuses to terminate) answers
200 `cancelling`, not 500, and the run is terminated once it has started: the batch ends `cancelled`
and its run CANCELED. Not covered here: cancelling queued or running batches (test_batch_api.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_pipeline_tests.api_service import (RUN_TIMEOUT, client, request_line, run_status, service_stack, upload)
from batch_pipeline_tests.dagster_server import wait_for

KEY = "key-cancel-0123456789"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with service_stack(tmp_path_factory.mktemp("cancel"), tiny_model_dir, {"BATCH_API_KEYS": f"team-a:{KEY}"}) as s:
        yield s


def test_a_cancel_while_the_run_is_starting_is_taken_and_carried_out(stack):
    sdk, server = client(stack["url"], KEY), stack["server"]
    lines = [request_line(f"c-{i}", max_tokens=200) for i in range(2000)]  # minutes: it must not finish first
    batch = sdk.batches.create(input_file_id=upload(sdk, lines).id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_for("the run STARTING", lambda: run_status(server, batch.id) == "STARTING", RUN_TIMEOUT, interval=0.1,
             on_timeout=server.log_tail)
    cancelled = sdk.batches.cancel(batch.id)  # Dagster refuses to terminate a STARTING run: 500 before
    assert cancelled.status == "cancelling"

    def ended() -> Any:
        current = sdk.batches.retrieve(batch.id)  # a read carries out a cancel left pending
        return current if current.status in ("cancelled", "completed", "failed", "expired") else None

    final = wait_for(f"batch {batch.id} ended", ended, RUN_TIMEOUT, interval=1.0, on_timeout=server.log_tail)
    assert final.status == "cancelled" and run_status(server, batch.id) == "CANCELED"
    assert final.request_counts.completed < len(lines)  # stopped, not answered to the end

"""Cancelling a batch whose run Dagster is still starting: `batch-pipeline serve` over a real `dagster
dev` (its daemon launching runs of the tiny model), driven by the openai SDK.

Covered: a cancel that arrives while the run is STARTING (which Dagster refuses to terminate) answers
200 `cancelling`, not 500, and the run is terminated once it has started: the batch ends `cancelled`
and its run CANCELED; the service's sweep carries a pending cancel out without a read (Dagster's side
scripted); a terminate Dagster half-did (the run marked CANCELING, its interrupt not delivered: the run
stops itself, test_run_watch.py) is taken, not a 500. Not covered here: cancelling queued or running
batches (test_batch_api.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_pipeline_tests.support.api_service import (RUN_TIMEOUT, client, request_line, run_status, service_stack,
                                                      upload, wait_run_status)
from batch_pipeline_tests.support import wait_for

KEY = "key-cancel-0123456789"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with service_stack(tmp_path_factory.mktemp("cancel"), tiny_model_dir, {"BATCH_API_KEYS": f"team-a:{KEY}"},
                       engine_url=warm_engine_url) as s:
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
    assert final.status == "cancelled"
    # The run writes its cancelled batch.json (its files final) before its step returns, so Dagster marks
    # it CANCELED a moment after the batch reads cancelled: CANCELING meanwhile (failed CI once, 8b708fb).
    assert wait_run_status(server, batch.id, ("CANCELED", "FAILURE", "SUCCESS"), timeout=120) == "CANCELED"
    assert final.request_counts.completed < len(lines)  # stopped, not answered to the end


class StartingRun:
    """Dagster's side of one run, scripted: STARTING (terminate refused, as Dagster refuses), then STARTED."""

    def __init__(self) -> None:
        self.status, self.terminated = "STARTING", []

    def current_run(self, record: Any) -> tuple[str, str]:
        return record.run_id, self.status

    def terminate_run(self, run_id: str) -> None:
        if self.status == "STARTING":
            raise RuntimeError("Run is in status STARTING and cannot be terminated")
        self.terminated.append(run_id)
        self.status = "CANCELING"


def test_a_cancel_left_pending_is_carried_out_by_the_sweep_without_a_read(tmp_path):
    """`batch-pipeline serve` sweeps every few seconds: the run is terminated once started even if no
    client reads the batch again (before, only a retrieve or a list carried it out)."""
    from batch_pipeline.io import storage
    from batch_pipeline.service.batches.protocol import BatchRecord
    from batch_pipeline.service.operations import PENDING_FOLDER, Service
    from batch_pipeline.service.store import Store

    dagster = StartingRun()
    service = Service(store=Store(str(tmp_path)), keys={"k" * 16: "team-a"}, dagster_url="http://unused",
                      _dagster=dagster)
    record = BatchRecord(id="batch_1", tenant="team-a", run_id="run-1", created_at=1)
    service.store.add_batch(record)
    pending = tmp_path / "_batch_api" / PENDING_FOLDER

    service.terminate(record, wait=0)  # the cancel: the run is still starting
    assert service.store.batch("team-a", "batch_1").terminate_pending and (pending / "batch_1.json").exists()
    assert service.sweep_pending_terminations() == 0 and dagster.terminated == []  # still starting: left pending

    dagster.status = "STARTED"
    assert service.sweep_pending_terminations() == 1 and dagster.terminated == ["run-1"]
    assert service.store.batch("team-a", "batch_1").terminate_pending is None
    assert storage.list_objects(str(pending) + "/") == []  # nothing left to sweep
    assert service.sweep_pending_terminations() == 0 and dagster.terminated == ["run-1"]  # once only


class UninterruptibleRun(StartingRun):
    """Dagster's side when the interrupt is lost: the terminate mutation marks the run CANCELING and then
    fails (its code server does not know the run), as DefaultRunLauncher.terminate does."""

    def __init__(self) -> None:
        super().__init__()
        self.status = "STARTED"

    def terminate_run(self, run_id: str) -> None:
        self.status = "CANCELING"
        raise RuntimeError(f"Unable to terminate run {run_id}")


def test_a_cancel_dagster_marked_but_could_not_interrupt_is_taken_not_a_500(tmp_path):
    """The run is CANCELING (it stops itself: test_run_watch.py), so the cancel is answered as taken;
    any other failure of the terminate still raises."""
    from batch_pipeline.service.batches.protocol import BatchRecord
    from batch_pipeline.service.operations import Service
    from batch_pipeline.service.store import Store

    dagster = UninterruptibleRun()
    service = Service(store=Store(str(tmp_path)), keys={"k" * 16: "team-a"}, dagster_url="http://unused",
                      _dagster=dagster)
    record = BatchRecord(id="batch_1", tenant="team-a", run_id="run-1", created_at=1)
    service.store.add_batch(record)
    service.terminate(record, wait=0)
    assert dagster.status == "CANCELING" and service.store.batch("team-a", "batch_1").terminate_pending is None

    refused = UninterruptibleRun()
    refused.terminate_run = lambda run_id: (_ for _ in ()).throw(RuntimeError("web server unreachable"))  # status stays STARTED
    service = Service(store=Store(str(tmp_path / "b")), keys={"k" * 16: "team-a"}, dagster_url="http://unused",
                      _dagster=refused)
    service.store.add_batch(record.model_copy())
    with pytest.raises(RuntimeError, match="web server unreachable"):
        service.terminate(record.model_copy(), wait=0)

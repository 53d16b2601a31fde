"""A batch whose run failed is not reported failed while Dagster retries it or may still retry it.

Dagster 1.13 stores a run's failure first and tags the run `dagster/will_retry` in a second write
(the code server's orphaned-run check, or the auto-retry daemon's next pass when that write was
missed); the service reported `failed` in between, and an SDK client polling for a terminal status
stopped there while the retry answered on (test_batch_api's kill test, 3 failures in 6 runs).

Covered here with the rule itself (`retry_outcome`) and the real `Service` over a real local store,
the Dagster web server a stand-in answering run statuses: a failed run Dagster decided to retry, or
has not decided about yet, keeps the batch `in_progress` (retrieve, the open index, /metrics); a
decision not to retry, spent retries, retries off, or no decision within the grace period makes it
`failed`, naming the run and why, read once. Against a real `dagster dev` on the production instance
settings: test_batch_api's kill tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.service.dagster_client import (RETRY_DECISION_SECONDS, RETRYING, RetryPolicy, retry_outcome)
from batch_pipeline.service.store import Store

TENANT = "team-a"
LINE = b'{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
ON = RetryPolicy(enabled=True, max_retries=2)
NOW = 1_000_000.0


@pytest.mark.parametrize("tags, ended, policy, retrying, why", [
    ({"dagster/will_retry": "true"}, NOW - 600, ON, True, "retrying"),
    # Tagged for a retry that never came (no retry daemon): over, said so.
    ({"dagster/will_retry": "true"}, NOW - 3600, ON, False, "launched none in 900 s (is the dagster-daemon running?)"),
    ({"dagster/retry_number": "x"}, NOW, ON, True, "not decided yet"),  # a tag edited by hand: no crash
    ({"dagster/will_retry": "false"}, NOW, ON, False, "decided not to retry"),
    # The window this issue was about: failed, no tag yet.
    ({}, NOW - 1, ON, True, "not decided yet"),
    ({}, NOW - RETRY_DECISION_SECONDS - 1, ON, False, "no retry decision within 60 s"),
    ({}, None, ON, True, "not decided yet"),  # no end time read: not over
    ({"dagster/retry_number": "1"}, NOW, ON, True, "not decided yet"),
    ({"dagster/retry_number": "2"}, NOW, ON, False, "retries are spent (attempt 3, max_retries 2)"),
    ({"dagster/max_retries": "0"}, NOW, ON, False, "retries are spent (attempt 1, max_retries 0)"),
    ({"dagster/max_retries": "5", "dagster/retry_number": "2"}, NOW, ON, True, "not decided yet"),
    ({}, NOW, RetryPolicy(enabled=False, max_retries=0), False, "does not retry runs"),
    ({}, NOW, None, True, "not decided yet"),  # the instance's settings unknown: the grace period decides
    ({}, NOW - RETRY_DECISION_SECONDS - 1, None, False, "no retry decision"),
])
def test_a_failed_run_is_over_only_once_dagster_will_not_retry_it(tags, ended, policy, retrying, why):
    outcome = retry_outcome(tags, ended, policy, NOW)
    assert outcome.retrying is retrying and why in outcome.why, outcome


class Runs:
    """The Dagster web server's answers the service needs: a run id at submit, then a status (as
    DagsterClient.current_run reports it) and, for a run failed for good, why."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}
        self.asked_why: list[str] = []

    def submit(self, record: Any) -> str:
        record.turn = 0
        self.status[record.id] = "STARTED"
        return f"run-{record.id}"

    def current_run(self, record: Any) -> tuple[str, str | None]:
        return record.run_id, self.status.get(record.id)

    def failure_reason(self, run_id: str) -> str:
        self.asked_why.append(run_id)
        return "Run execution process was terminated by signal 9 (SIGKILL). Not retried: its retries are spent"

    def graphql(self, query: str) -> dict[str, Any]:  # /metrics' run queue figures: none queued
        return {"runsOrError": {"count": 0, "results": []}}


@pytest.fixture
def service(tmp_path: Path) -> Any:
    from batch_pipeline.service.operations import Service

    return Service(Store(str(tmp_path / "out")), {"k" * 16: TENANT}, "http://127.0.0.1:9", _dagster=Runs())


def metrics_line(service: Any, status: str) -> str:
    from batch_pipeline.service.app import figures
    from batch_pipeline.service.prometheus import DateLines, FinishedBatches

    text = figures(service, FinishedBatches(), DateLines())
    return next(line for line in text.splitlines() if line.startswith(f'batch_pipeline_api_batches{{status="{status}"}}'))


def test_a_retrying_batch_stays_in_progress_everywhere_and_a_failed_one_says_why(service):
    source = service.create_file(TENANT, "one.jsonl", "batch", LINE)
    batch_id = service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
    store, runs = service.store, service.dagster
    runs.status[batch_id] = RETRYING
    assert service.batch_object(store.batch(TENANT, batch_id)).status == "in_progress"
    assert [r.id for r in store.open_batches(TENANT)] == [batch_id]  # still counted against the limit
    assert metrics_line(service, "failed").endswith(" 0") and metrics_line(service, "in_progress").endswith(" 1")
    assert runs.asked_why == []
    # Dagster decided: over. The error names the run and the reason, read once and kept in the record.
    runs.status[batch_id] = "FAILURE"
    failed = service.batch_object(store.batch(TENANT, batch_id)).body()
    assert failed["status"] == "failed" and store.open_batches(TENANT) == []
    [error] = failed["errors"]["data"]
    assert error["code"] == "run_failed" and f"run-{batch_id}" in error["message"], error
    assert "signal 9" in error["message"] and "retries are spent" in error["message"], error
    again = service.batch_object(store.batch(TENANT, batch_id)).body()
    assert again["errors"] == failed["errors"] and again["failed_at"] == failed["failed_at"]
    assert runs.asked_why == [f"run-{batch_id}"]
    assert metrics_line(service, "failed").endswith(" 1")
    # A retry Dagster launched after all (its daemon was behind): the batch is taken up again, back
    # among its tenant's open batches and counted as not over, not kept as failed.
    from batch_pipeline.service.prometheus import FinishedBatches

    kept = FinishedBatches()
    assert [b["status"] for _, b in kept.batches(store, service.batch_object)] == ["failed"]
    runs.status[batch_id] = "QUEUED"  # the retry run, in the queue (no lines validated in this stand-in)
    assert service.batch_object(store.batch(TENANT, batch_id)).status == "validating"
    assert [r.id for r in store.open_batches(TENANT)] == [batch_id] and store.batch(TENANT, batch_id).run_failure is None
    assert [b["status"] for _, b in kept.batches(store, service.batch_object)] == ["validating"]


def test_a_cancel_of_a_retrying_batch_is_carried_out_on_the_retry_run(service):
    """Nothing can be terminated while the failed run's retry is not queued yet: the cancel waits for
    it (as for a run still starting) and terminates the retry once it appears; a cancel left pending
    (the retry later than the wait) is carried out by the sweep."""
    source = service.create_file(TENANT, "one.jsonl", "batch", LINE)
    runs, terminated = service.dagster, []
    runs.terminate_run = lambda run_id: terminated.append(run_id)
    first = service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
    answers = iter([RETRYING, RETRYING, "QUEUED"])  # the retry run (with the batch's tag) appears at the third look
    runs.current_run = lambda record: (record.run_id, next(answers, "CANCELING"))
    assert service.cancel_batch(TENANT, first).status == "cancelling"
    assert terminated == [f"run-{first}"] and not service.store.batch(TENANT, first).terminate_pending
    second = service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
    runs.current_run = lambda record: (record.run_id, RETRYING)
    service.terminate(service.store.batch(TENANT, second), wait=0)
    assert terminated == [f"run-{first}"] and service.store.batch(TENANT, second).terminate_pending
    runs.current_run = lambda record: (record.run_id, "QUEUED")
    assert service.sweep_pending_terminations() == 1 and terminated == [f"run-{first}", f"run-{second}"]

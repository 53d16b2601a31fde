"""The production instance (deploy/dagster.yaml) under a real `dagster dev`: a killed run is retried and resumes.

Covers: `dagster dev` started with deploy/dagster.yaml in DAGSTER_HOME and DAGSTER_POSTGRES_* pointing at a
fresh PostgreSQL database (dropped at the end); batch_job launched over GraphQL for one partition, queued
and dequeued by the daemon; the run worker (the in-process executor, so the process doing the inference)
SIGKILLed once the first checkpoint part is on disk; the code server noticing the dead process and
failing the run (the code server's orphan check, not run monitoring: DefaultRunLauncher has no worker
health check); the run-retry daemon (run_retries, max 2) launching a re-execution from failure that the
queue holds until the monitoring daemon frees the dead run's "gpu" slot
(run_monitoring.free_slots_after_run_end_seconds), and that resumes from the checkpoints ("N of M
requests already answered; resuming") and succeeds; the files (every custom_id answered exactly once,
batch.json completed); and both runs plus the retry's materialization of batch_outputs, read with plain
SQL from the runs and event_logs tables.

Uses local folders for input/output (S3 is covered by test_dagster_e2e.py) and the tiny random model.
Skipped, saying why, when nothing listens on 127.0.0.1:5432.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline_tests.cli_runs import jsonl_records
from batch_pipeline_tests.conftest import TINY_NAME
from batch_pipeline_tests.dagster_server import LOCATION, REPO, REPOSITORY, DagsterDev, pipeline_env, start_dagster_dev, wait_for
from batch_pipeline_tests.test_postgres import PG_HOST, PG_PASSWORD, PG_PORT, PG_USER, _connect, _reachable, fresh_database

pytestmark = pytest.mark.skipif(_reachable() is not None, reason=_reachable() or "")

BATCH = "prod-chat"
REQUESTS = 200
SHARD = 10
PARTITION = (dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=3)).isoformat()
IDS = [f"req-{i:04d}" for i in range(REQUESTS)]


def chat_line(i: int) -> str:
    # The whole batch is in the engine at once; staggered lengths (ignore_eos: exactly max_tokens
    # each) make answers finish one by one, so checkpoint parts appear while most are still running.
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"count for {IDS[i]}"}],
            "max_tokens": 16 + i, "ignore_eos": True}
    return json.dumps({"custom_id": IDS[i], "method": "POST", "url": "/v1/chat/completions", "body": body})


@pytest.fixture
def database() -> Iterator[str]:
    with fresh_database("batch_pipeline_prod") as name:
        yield name


@pytest.fixture
def production(database: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    inbox, out = tmp_path / "in", tmp_path / "out"
    (inbox / PARTITION).mkdir(parents=True)
    (inbox / PARTITION / f"{BATCH}.jsonl").write_text("\n".join(chat_line(i) for i in range(REQUESTS)) + "\n")
    pg = {
        "DAGSTER_POSTGRES_USER": PG_USER,
        "DAGSTER_POSTGRES_PASSWORD": PG_PASSWORD,
        "DAGSTER_POSTGRES_HOSTNAME": PG_HOST,
        "DAGSTER_POSTGRES_DB": database,
        "DAGSTER_POSTGRES_PORT": str(PG_PORT),
    }
    for key, value in pg.items():  # server.instance() in this process reads them too
        monkeypatch.setenv(key, value)
    env: dict[str, str | None] = {**pg, **pipeline_env(tiny_model_dir, str(inbox), str(out), SHARD_SIZE=str(SHARD))}
    server = start_dagster_dev(tmp_path / "home", env, tmp_path / "dagster-dev.log",
                               instance_yaml=REPO / "deploy" / "dagster.yaml")
    try:
        yield server, out / PARTITION / BATCH, database
    finally:
        print(f"dagster dev log: {server.log_path}")
        server.stop()


def launch_partition(server: DagsterDev, partition: str) -> str:
    data = server.graphql(
        """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
             __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
             ... on RunConfigValidationInvalid { errors { message } } } }""",
        {"p": {"selector": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "jobName": "batch_job"},
               "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition}]},
               "runConfigData": {}}},
    )["launchRun"]
    assert data["__typename"] == "LaunchRunSuccess", data
    return data["run"]["runId"]


def run_worker_pid(server: DagsterDev, run_id: str) -> int | None:
    for entry in server.instance().all_logs(run_id):
        message = entry.message or ""
        if message.startswith("Started process for run (pid: "):
            return int(message.split("pid: ")[1].rstrip(")."))
    return None


def messages(server: DagsterDev, run_id: str) -> list[str]:
    return [e.message or "" for e in server.instance().all_logs(run_id)]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return jsonl_records(path.read_text())


def test_killed_run_is_retried_and_resumes_with_postgres(production) -> None:
    server, out, database = production
    t0 = time.monotonic()
    first = launch_partition(server, PARTITION)

    pid = wait_for("the run worker's pid", lambda: run_worker_pid(server, first), 60, on_timeout=server.log_tail)
    parts = out / "_work" / "answers"
    wait_for("the first checkpoint part", lambda: list(parts.glob("*/part-*.jsonl")), 120, interval=0.1,
             on_timeout=server.log_tail)
    done_at_kill = sum(p.read_text().count("\n") for p in parts.glob("*/part-*.jsonl"))
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    assert done_at_kill < REQUESTS, "the batch finished before the kill: make it bigger"

    import dagster as dg

    def retry_run() -> Any:
        runs = server.instance().get_runs(filters=dg.RunsFilter(tags={"dagster/parent_run_id": first}))
        return runs[0] if runs else None

    retry = wait_for("a retry of the killed run", retry_run, 60, on_timeout=server.log_tail)
    t_retry = time.monotonic()

    def finished() -> Any:
        run = server.instance().get_run_by_id(retry.run_id)
        return run if run.is_finished else None

    retry = wait_for(f"retry {retry.run_id} finished", finished, 150,
                     on_timeout=lambda: "\n".join(messages(server, retry.run_id)[-30:]) + "\n" + server.log_tail())
    t_done = time.monotonic()
    print(f"first part at kill: {t_kill - t0:.1f}s ({done_at_kill} answered); retry launched "
          f"{t_retry - t_kill:.1f}s after the kill; retry finished {t_done - t_retry:.1f}s later")

    killed = server.instance().get_run_by_id(first)
    assert killed.status == dg.DagsterRunStatus.FAILURE
    assert any("terminated by signal 9" in m for m in messages(server, first)), messages(server, first)
    assert retry.status == dg.DagsterRunStatus.SUCCESS, "\n".join(messages(server, retry.run_id)[-30:])
    assert retry.tags["dagster/retry_number"] == "1"
    assert retry.tags["dagster/partition"] == PARTITION
    resumed = [m for m in messages(server, retry.run_id) if "requests already answered; resuming" in m]
    assert resumed, messages(server, retry.run_id)
    already = int(resumed[0].split(": ", 1)[1].split(" of ")[0])
    assert done_at_kill <= already < REQUESTS
    assert f" of {REQUESTS} requests" in resumed[0]

    outputs, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    answered = [o["custom_id"] for o in outputs] + [e["custom_id"] for e in errors]
    assert sorted(answered) == IDS  # every request exactly once
    assert not errors
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}
    assert batch["metadata"]["dagster_run_id"] == retry.run_id

    # The same facts straight from PostgreSQL, not through Dagster's storage classes.
    conn = _connect(database)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT run_id, status FROM runs WHERE pipeline_name = 'batch_job'")
            assert dict(cur.fetchall()) == {first: "FAILURE", retry.run_id: "SUCCESS"}
            cur.execute("SELECT run_id FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
                        " AND asset_key = %s", (json.dumps(["batch_outputs"]),))
            assert [r[0] for r in cur.fetchall()] == [retry.run_id]
    finally:
        conn.close()

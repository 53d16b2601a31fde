"""Tests for deploy/dagster.yaml against a real PostgreSQL: the production instance records runs there.

Covers: the instance loaded from deploy/dagster.yaml in a temporary DAGSTER_HOME, with DAGSTER_POSTGRES_*
pointing at a fresh database created for this module on 127.0.0.1:5432 (dropped at the end): its
storages are PostgreSQL and its run queue, GPU pool, retries and telemetry are as configured; the real
`validated_requests` asset materialized in-process on a small batch file is recorded, as seen through
the instance (get_runs, get_latest_materialization_event) and through plain SQL on the runs and
event_logs tables (psycopg2); and the doctor's instance check against that database, including a
clear failure for an unreachable server or a missing variable.

Loads no model in its own process (validation needs none; the console-script run answers on the test
run's warm engine, which it starts if no other file has), and starts no daemon, webserver or code
server; files stay in pytest's tmp_path. Skipped, saying why, when nothing listens on 127.0.0.1:5432.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.defs.assets import validated_requests
from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
from batch_pipeline.cli import doctor
from batch_pipeline_tests.support import REPO
from batch_pipeline_tests.support.postgres_db import PG_HOST, PG_PASSWORD, PG_PORT, PG_USER, connect, fresh_database, reachable

PARTITION = "2024-06-01"
SERVED = "test-model"

pytestmark = pytest.mark.skipif(reachable() is not None, reason=reachable() or "")


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """A fresh database for this module."""
    with fresh_database("batch_pipeline_test") as name:
        yield name


@pytest.fixture
def dagster_home(tmp_path: Path, database: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DAGSTER_HOME holding deploy/dagster.yaml, and the DAGSTER_POSTGRES_* variables it reads."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DAGSTER_POSTGRES_USER", PG_USER)
    monkeypatch.setenv("DAGSTER_POSTGRES_PASSWORD", PG_PASSWORD)
    monkeypatch.setenv("DAGSTER_POSTGRES_HOSTNAME", PG_HOST)
    monkeypatch.setenv("DAGSTER_POSTGRES_DB", database)
    monkeypatch.setenv("DAGSTER_POSTGRES_PORT", str(PG_PORT))
    return home


def _line(custom_id: str, model: str = SERVED) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_instance_has_postgres_storage_and_production_settings(dagster_home: Path):
    with dg.DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert type(instance.run_launcher).__name__ == "DefaultRunLauncher"
        concurrency = instance.get_concurrency_config()
        assert concurrency.pool_config.default_pool_limit == 1
        assert concurrency.run_queue_config.max_concurrent_runs == 10
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert not instance.telemetry_enabled


def test_materialization_is_recorded_in_postgres(dagster_home: Path, database: str, tmp_path: Path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join([_line("a"), _line("b"), _line("c", model="other-model")]) + "\n")
    out = tmp_path / "out"
    run_config = batch_run_config(str(batch), str(out))

    with dg.DagsterInstance.get() as instance:
        result = dg.materialize(
            [validated_requests],
            partition_key=PARTITION,
            run_config=run_config,
            resources={"batch": BatchSelection(), "llm": LLMResource(served_model_name=SERVED), "storage": StorageResource()},
            instance=instance,
        )
        assert result.success
        run_id = result.run_id

        (run,) = instance.get_runs(limit=1)
        assert run.run_id == run_id
        assert run.status == dg.DagsterRunStatus.SUCCESS
        event = instance.get_latest_materialization_event(dg.AssetKey("validated_requests"))
        assert event is not None and event.run_id == run_id
        materialization = event.asset_materialization
        assert materialization.partition == PARTITION
        assert materialization.metadata["valid"].value == 2
        assert materialization.metadata["invalid"].value == 1

    assert json.loads((out / "_work" / "validation.json").read_text())["valid"] == 2

    # The same facts straight from the tables, without Dagster in between.
    conn = connect(database)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT status FROM runs WHERE run_id = %s", (run_id,))
            assert cur.fetchall() == [("SUCCESS",)]
            cur.execute(
                "SELECT count(*) FROM event_logs WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'"
                " AND asset_key LIKE %s AND partition = %s",
                (run_id, "%validated_requests%", PARTITION),
            )
            assert cur.fetchone() == (1,)
    finally:
        conn.close()


def test_doctor_passes_against_postgres(dagster_home: Path):
    (result,) = doctor.run_checks(only=["dagster instance"])
    assert result.status == "PASS", result.detail
    assert "PostgresRunStorage" in result.detail


def test_doctor_fails_clearly_when_the_database_is_unreachable(dagster_home: Path, monkeypatch: pytest.MonkeyPatch):
    import dagster_postgres.utils

    # dagster-postgres retries a refused connection with exponential backoff (~10 s); skip the waits.
    monkeypatch.setattr(dagster_postgres.utils, "calculate_delay", lambda **_kwargs: 0)
    monkeypatch.setenv("DAGSTER_POSTGRES_PORT", "9")
    (result,) = doctor.run_checks(only=["dagster instance"])
    assert result.status == "FAIL"
    assert str(dagster_home) in result.detail
    assert "OperationalError" in result.detail and "port 9" in result.detail, result.detail


def test_doctor_names_a_missing_database_variable(dagster_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DAGSTER_POSTGRES_PASSWORD")
    (result,) = doctor.run_checks(only=["dagster instance"])
    assert result.status == "FAIL"
    assert "DAGSTER_POSTGRES_PASSWORD" in result.detail


def test_doctor_in_a_helm_code_server_pod_uses_the_charts_password_variable(dagster_home: Path, monkeypatch: pytest.MonkeyPatch):
    # The chart sets DAGSTER_PG_PASSWORD (and values.yaml the other DAGSTER_POSTGRES_*), not DAGSTER_POSTGRES_PASSWORD.
    password = os.environ["DAGSTER_POSTGRES_PASSWORD"]
    monkeypatch.delenv("DAGSTER_POSTGRES_PASSWORD")
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", password)
    (result,) = doctor.run_checks(only=["dagster instance"])
    assert result.status == "PASS", result.detail
    assert "DAGSTER_POSTGRES_PASSWORD" not in os.environ  # borrowed for the check only


def test_console_script_run_is_recorded_in_postgres(dagster_home: Path, database: str, tmp_path: Path, tiny_model_dir,
                                                     warm_engine_url: str):
    """The issue's own check: `batch-pipeline run` with the production instance leaves a successful
    run and all four materializations in PostgreSQL (a new process; real vLLM: the test run's warm
    engine on the tiny model, so this process imports none; test_cli.py runs the in-process path)."""
    import subprocess
    import sys

    from batch_pipeline_tests.support import TINY_NAME, tiny_env

    batch = tmp_path / "pg.jsonl"
    batch.write_text("\n".join([_line("a", TINY_NAME), _line("b", TINY_NAME)]) + "\n")
    env = tiny_env(tiny_model_dir, DAGSTER_HOME=os.environ["DAGSTER_HOME"], ENGINE_URL=warm_engine_url, **{
        k: v for k, v in os.environ.items() if k.startswith("DAGSTER_POSTGRES_")})
    script = Path(sys.executable).parent / "batch-pipeline"
    proc = subprocess.run([str(script), "run", str(batch), "--output-dir", str(tmp_path / "out"), "--date", PARTITION],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    conn = connect(database)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT run_id, status FROM runs ORDER BY id DESC LIMIT 1")  # the newest: this test's
            [(run_id, status)] = cur.fetchall()
            assert status == "SUCCESS"
            cur.execute("SELECT value FROM run_tags WHERE run_id = %s AND key = 'batch_pipeline/source'", (run_id,))
            assert cur.fetchall() == [("cli",)]
            cur.execute(
                "SELECT asset_key FROM event_logs WHERE run_id = %s AND dagster_event_type = 'ASSET_MATERIALIZATION'",
                (run_id,),
            )
            keys = sorted(json.loads(k)[0] for (k,) in cur.fetchall())  # stored as ["name"]
            assert keys == ["batch_outputs", "inference_results", "throughput_metrics", "validated_requests"]
    finally:
        conn.close()

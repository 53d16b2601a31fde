"""Shared fixtures and hooks: real vLLM engines built once per test session, and a real S3 server.

vLLM is imported and each engine is built at most once per session (a tiny random Llama for most
tests, the bundled SmolLM2 only where a test checks real answers), then shared through a resource
that hands the same engine to every run instead of building a new one.

Only what pytest looks for lives here (fixtures, hooks, plugins, the process set-up that must come
before any import); the names test files share are in `batch_pipeline_tests.support`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Share the bundled model with `make demo`; the Makefile sets the same folder.
os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))
# The Makefile exports DAGSTER_HOME for demo/dev; test runs must not land in (or need) that
# instance: tests that want one make their own.
os.environ.pop("DAGSTER_HOME", None)
# The tests' batch files carry dates back to 2024 (the partitions are read when the definitions
# load, so this is set before any import of them; subprocesses inherit it). The default start is
# tested on its own (test_settings.py).
os.environ["PARTITIONS_START"] = "2024-01-01"
# OpenMP threads (torch's libgomp, which vLLM's CPU kernels run on) sleep when idle instead of
# spinning: the suite runs engines in two workers and in their subprocesses at once on 2 cores, and
# a spinning thread takes the core from the one that has work. Set before torch is first imported
# (here, in the run workers, the CLI runs and the engine ranks: they inherit it). Measured with two
# `batch-pipeline run`s of 512 x 64 on the tiny model at once: inference 4.3-4.6 s each against
# 10.1-10.2 s with the default policy, 19 against 26 CPU-seconds a run; a run alone is the same
# either way within this machine's noise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from batch_pipeline.config import models  # noqa: E402
from batch_pipeline.base.runtime import configure_runtime_env  # noqa: E402
from batch_pipeline_tests.support import (  # noqa: E402  (the shared helpers; test files import them from there)
    TEST_KV_BYTES,
    TINY_MAX_MODEL_LEN,
    TINY_NAME,
    SessionLLM,
    shutdown_session_engines,
)
from batch_pipeline_tests.support.tiny_model import build_tiny_llama  # noqa: E402

pytest_plugins = [
    "batch_pipeline_tests.support.s3_server",
    "batch_pipeline_tests.support.cli_runs",
    "batch_pipeline_tests.support.sensor_ticks",
    "batch_pipeline_tests.support.thinking_llm",
]


@pytest.fixture(scope="session", autouse=True)
def _runtime_env():
    configure_runtime_env(models.cache_root())
    yield
    shutdown_session_engines()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_llama(models.cache_root() / "test-models" / TINY_NAME)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    return models.prepare_bundled_model(log=lambda _m: None)


@pytest.fixture(scope="session")
def warm_engine_url(tiny_model_dir: Path) -> str:
    """The test run's one warm engine on the tiny model (vLLM's server, shared by both pytest workers,
    stopped when the run ends): ENGINE_URL for the files that run many pipelines."""
    from batch_pipeline_tests.support.warm_engine import shared_url

    return shared_url(tiny_model_dir)


@pytest.fixture
def tiny_llm(tiny_model_dir, monkeypatch) -> SessionLLM:
    """The LLM resource on the tiny random model (answers are gibberish; shapes and counts are real)."""
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "MAX_MODEL_LEN", "SHARD_SIZE", "CHECKPOINT_ANSWERS", "CHECKPOINT_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KV_CACHE_MEMORY_BYTES", str(TEST_KV_BYTES))
    return SessionLLM(model_path=str(tiny_model_dir), served_model_name=TINY_NAME, max_model_len=TINY_MAX_MODEL_LEN)


@pytest.fixture
def smollm2_llm(bundled_model_dir, monkeypatch) -> SessionLLM:
    """The LLM resource on the bundled SmolLM2-135M-Instruct (real answers)."""
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "SHARD_SIZE", "CHECKPOINT_ANSWERS", "CHECKPOINT_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KV_CACHE_MEMORY_BYTES", str(512 * 2**20))
    return SessionLLM(max_model_len=2048)


# Test files that start real servers and subprocesses (dagster dev, the Batch API, engine ranks,
# Chromium), costliest first: seconds of test time each (setup, calls and teardown of its tests, from
# --durations=0) in a full `make test` on 2 workers, a fresh clone on 2026-12-07 (1100 passed in 13:31).
# `make test` hands out whole files in collection order (pytest-xdist --dist loadfile
# --no-loadscope-reorder), and these come first, so the run does not end on one of them while the
# other worker has nothing left. (xdist's default order, most tests first, put the files with few
# long tests last.) The other files follow in their usual order.
SLOW_FILES = (
    "test_ui_walkthrough.py",  # 139 s: Chromium over dagster dev, a backfill of two dates and re-runs
    "test_service_priority.py",  # 107 s: queued runs that must come up one after another (their order is the point)
    "test_batch_api.py",  # 111 s
    "test_remote_engine.py",  # 149 s: two vLLM servers started together, one restarted
    "test_dagster_e2e.py",  # 147 s: four dagster devs, make dev's engine, the sensor, the SQS queue
    "test_data_parallel.py",  # 174 s
    "test_engine_multiprocess.py",  # 113 s
    "test_service_model_versions.py",  # 48 s: three API batches in turn
    "test_service_usage.py",  # 23 s: three real runs of two tenants
    "test_cli.py",  # 52 s: real batch-pipeline processes, two at a time
    "test_images_pipeline.py",  # 50 s
    "test_model_versions.py",  # 30 s: two model verify processes at once
    "test_alert_sensor_e2e.py",  # 18 s
    "test_reliability.py",  # 36 s
    "test_shards.py",  # 33 s
    "test_service_cancel.py",  # 32 s
    "test_service_audit.py",  # 31 s
)


# The fast lane (`make test-fast`: -m "not engine and not server and not slow"; `slow` is set by hand
# on tests of several seconds that need neither, e.g. run workers' own processes): a test is marked by what it
# uses, so a new test that builds an engine or starts a server leaves the lane by itself. Every
# fixture that loads a model (directly or through the fixtures built on it) ...
# The tiny vision model's folder, and `cli_runs` (a `batch-pipeline run` in its own process, which
# builds its own engine) count too: without them three image tests (~75 s) ran in the fast lane.
ENGINE_FIXTURES = {"tiny_model_dir", "bundled_model_dir", "thinking_model_dir", "vlm_dir", "cli_runs"}
# ... and every fixture that starts a server (moto's S3, a PostgreSQL database; dagster dev, the
# Batch API and Chromium start from fixtures that need the tiny model too).
SERVER_FIXTURES = {"moto_server", "history_server", "database", "warm_engine_url"}


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or the only process) makes the folder the run's shared warm engine is kept in;
    pytest-xdist's workers inherit it through the environment."""
    from batch_pipeline_tests.support.warm_engine import CONTROLLER_ENV, SHARED_ENV

    if not hasattr(config, "workerinput"):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="batch-pipeline-tests-")
        os.environ[CONTROLLER_ENV] = str(os.getpid())  # the shared engine stops when this process is gone


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller stops the shared warm engine once every worker is done."""
    from batch_pipeline_tests.support.warm_engine import SHARED_ENV, stop_shared

    if not hasattr(config, "workerinput") and SHARED_ENV in os.environ:
        stop_shared()
        shutil.rmtree(os.environ.pop(SHARED_ENV), ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
        if used & SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)

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
import signal
import subprocess
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
# Chromium). `make test` hands out whole files in collection order (pytest-xdist --dist loadfile
# --no-loadscope-reorder), and these come first, so the run does not end on one of them while the
# other worker has nothing left. (xdist's default order, most tests first, put the files with few
# long tests last.) The other files follow in their usual order.
#
# They alternate between files that compute (vLLM imports and engines in their own processes) and
# files that mostly wait (on dagster dev's daemons and queue), so the two workers' files at any moment
# are one of each: two computing files side by side share the 2 cores and both slow down, two waiting
# ones leave them idle. Figures: CPU-seconds of the file's processes / seconds of the file, in a whole
# `make test` on 2 workers, 2026-12-07 (every process's CPU time read from /proc every 0.5 s, each
# charged to the test running on the worker it descends from). In the order before this one the first
# three minutes kept the cores 49-75% busy (two waiting files), the next three 83-99%.
SLOW_FILES = (
    "test_data_parallel.py",  # 138 CPU-s / 151 s: two runs of two engine ranks each, then a rank killed
    "test_service_priority.py",  # 30 / 72: queued runs that must come up one after another (their order is the point)
    "test_batch_api.py",  # 35 / 96: runs on the shared warm engine; waits for kills, retries and expiries
    "test_engine_multiprocess.py",  # 132 / 141: three runs with engine-core processes, interrupted
    "test_ui_walkthrough.py",  # 97 / 120: Chromium over dagster dev, a backfill of a date's files and re-runs
    "test_remote_engine.py",  # 114 / 141: vLLM servers started together, one restarted
    "test_dagster_e2e.py",  # 100 / 93: four dagster devs, make dev's engine, the sensor, the SQS queue
    "test_alert_sensor_e2e.py",  # 14 / 26: the daemon's alert sensor posting to a webhook
    "test_service_model_versions.py",  # 49 / 45: three API batches in turn, each run loading its version
    "test_service_usage.py",  # 15 / 24: three real runs of two tenants
    "test_cli.py",  # real batch-pipeline processes
    "test_service_audit.py",  # 15 / 23
    "test_images_pipeline.py",  # 41 / 51
    "test_service_cancel.py",  # 13 / 17
    "test_model_versions.py",  # 37 / 48: two model verify processes at once
    "test_reliability.py",  # 37 / 38
    "test_shards.py",  # 30 / 22
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


INSPECTION = pytest.StashKey["subprocess.Popen | None"]()  # support/model_inspection.py's process


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or the only process) makes the folder the run's shared warm engine is kept in;
    pytest-xdist's workers inherit it through the environment. Unless only the fast lane runs, it
    also has vLLM inspect the suite's model classes once, in the background (model_inspection.py)."""
    from batch_pipeline_tests.support.warm_engine import CONTROLLER_ENV, SHARED_ENV

    if not hasattr(config, "workerinput"):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="batch-pipeline-tests-")
        os.environ[CONTROLLER_ENV] = str(os.getpid())  # the shared engine stops when this process is gone
        if "not engine" not in (config.option.markexpr or ""):  # the fast lane builds no engine
            from batch_pipeline_tests.support import model_inspection

            config.stash[INSPECTION] = model_inspection.start(models.cache_root())


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller stops the shared warm engine once every worker is done."""
    from batch_pipeline_tests.support.warm_engine import SHARED_ENV, stop_shared

    if not hasattr(config, "workerinput") and SHARED_ENV in os.environ:
        stop_shared()
        shutil.rmtree(os.environ.pop(SHARED_ENV), ignore_errors=True)
    inspection = config.stash.get(INSPECTION, None)
    if inspection is not None:  # done long ago in a full run; a short run waits for it (once: its marker)
        try:
            inspection.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(inspection.pid, signal.SIGKILL)
            inspection.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: the rest keep their order
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
        if used & SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)

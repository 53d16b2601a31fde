"""`ForkedRunLauncher`: Dagster's run launcher for one machine, each run's worker a fork of a warm process.

Dagster's default launcher asks the code server to start each run, and the code server starts a new
Python process for it: Python, Dagster and the pipeline are imported again before the run does anything
(about 1.5 CPU-s a run here, and most of a file run's start when three start at once on 2 cores;
docs/PERFORMANCE.md). On a warm engine a file run answers in about a second, so that start was most of
what it cost.

This launcher starts each run's worker as a fork of a warm process instead: Python's multiprocessing
fork server, started on the first launch, which imports defs/run_worker.py (Dagster's run execution
and the pipeline's wiring, never vLLM) once. The worker runs what the default launcher's runs run,
`dagster api execute_run`, and the run's event log says it was forked (or started afresh, when the
project's code changed since the fork server imported it: an edit behaves as with the default launcher).
A code location with another Python (its `executable_path`) gets a new process of that Python.

What the default launcher's code server does for its runs, this launcher does for its own:
- a worker that dies before its run finished fails the run, with Dagster's own wording of the exit
  (a thread looks every WATCH_SECONDS), so run retries and the Batch API see it as before;
- `terminate` (the UI's Terminate, the Batch API's cancel) interrupts the worker with SIGTERM, which a
  run worker takes as Ctrl-C: the run ends CANCELED, its answers kept;
- run monitoring may ask whether a worker lives (`check_run_worker_health`).
The worker is found by the run's PID_TAG (its pid and start time, so a reused pid is never signalled),
so the web server can terminate a run the daemon launched. That is why it serves instances whose daemon,
web server and runs share one machine: `dagster dev`, `make dev` and the tests (dagster.yaml). deploy/
keeps Dagster's default launcher, whose runs start beside the code server in the container with the GPUs.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.launcher import CheckRunHealthResult, LaunchRunContext, RunLauncher, WorkerStatus
from dagster._grpc.types import ExecuteRunArgs
from dagster._serdes import ConfigurableClass, ConfigurableClassData, serialize_value
from dagster._utils import get_run_crash_explanation

# The run's worker: "<pid>@<start time in clock ticks since boot>" (Linux' /proc/<pid>/stat, field 22).
PID_TAG = "batch_pipeline/run_worker"
WARM_MODULE = "batch_pipeline.defs.run_worker"
WATCH_SECONDS = 1.0


def _run_worker(argv: list[str]) -> None:
    """The forked worker's entry: run_worker.py is already imported there (the fork server's preload)."""
    from batch_pipeline.defs.run_worker import execute_run

    execute_run(argv)


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None when it is gone or /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class ForkedRunLauncher(RunLauncher, ConfigurableClass):
    """Starts each run's worker as a fork of a process that has Dagster and the pipeline imported.
    `preload`: further modules the fork server imports (the code location's own, when it is not this
    project)."""

    def __init__(self, preload: Sequence[str] = (), inst_data: ConfigurableClassData | None = None) -> None:
        self._inst_data = inst_data
        self.preload = [WARM_MODULE, *preload]
        self._workers: dict[str, Any] = {}  # run id -> multiprocessing.Process or subprocess.Popen
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._forks: Any = None
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict:
        return {"preload": dg.Field([str], is_required=False, default_value=[])}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> ForkedRunLauncher:
        return cls(preload=config_value.get("preload") or (), inst_data=inst_data)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        origin = run.job_code_origin
        if origin is None:
            raise dg.DagsterInvariantViolationError(f"Run {run.run_id} has no code origin to start it from.")
        # The code location's Python runs the run, as Dagster's code server starts its runs with its own.
        args = ExecuteRunArgs(job_origin=origin, run_id=run.run_id, instance_ref=self._instance.get_ref())
        argv = [origin.executable_path, "-m", "dagster", "api", "execute_run", serialize_value(args)]
        if self.forks(argv):
            worker = self._fork_context().Process(target=_run_worker, args=(argv,), name=f"dagster run {run.run_id}")
            worker.start()
        else:  # another Python: a new process of it, as Dagster's own command-line launchers do
            worker = subprocess.Popen(argv)
        self._instance.add_run_tags(run.run_id, {PID_TAG: f"{worker.pid}@{process_start(worker.pid) or ''}"})
        with self._lock:
            self._workers[run.run_id] = worker
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="forked-run-watch", daemon=True)
                self._watcher.start()

    @staticmethod
    def forks(argv: Sequence[str]) -> bool:
        """Whether a run started with `argv` (`<python> -m dagster api execute_run ...`) can be a fork of
        this process: the same Python."""
        return os.path.abspath(argv[0]) == os.path.abspath(sys.executable)

    def _fork_context(self) -> Any:
        with self._lock:
            if self._forks is None:
                self._forks = multiprocessing.get_context("forkserver")
                self._forks.set_forkserver_preload(self.preload)
            return self._forks

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_SECONDS):
            with self._lock:
                ended = [(run_id, code) for run_id, worker in self._workers.items()
                         if (code := _exit_code(worker)) is not None]
                for run_id, _ in ended:
                    del self._workers[run_id]
            for run_id, code in ended:
                self._worker_ended(run_id, code)

    def _worker_ended(self, run_id: str, code: int) -> None:
        """As Dagster's code server does for a run process of its own: a worker that ended before its run
        did fails the run, saying how it ended."""
        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return
        message = get_run_crash_explanation(prefix=f"Run execution process for {run_id}", exit_code=code)
        self._instance.report_engine_event(message, run, cls=self.__class__)
        self._instance.report_run_failed(run)

    def _worker_pid(self, run: dg.DagsterRun) -> int | None:
        """The run's worker's pid while that process lives (whichever process launched it), else None."""
        pid, _, started = run.tags.get(PID_TAG, "").partition("@")
        if not pid.isdigit():
            return None
        now = process_start(int(pid))
        return int(pid) if now is not None and (not started or now == started) else None

    def terminate(self, run_id: str) -> bool:
        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return False
        self._instance.report_run_canceling(run)
        pid = self._worker_pid(run)
        if pid is None:
            self._instance.report_engine_event(
                "No run worker to interrupt: the run has not started one, or it has ended.", run, cls=self.__class__)
            return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        with self._lock:
            worker = self._workers.get(run.run_id)
        code = None if worker is None else _exit_code(worker)
        if worker is not None and code is not None:
            return CheckRunHealthResult(WorkerStatus.SUCCESS if code == 0 else WorkerStatus.FAILED,
                                        get_run_crash_explanation("Run worker", code) if code else None)
        if worker is not None or self._worker_pid(run) is not None:
            return CheckRunHealthResult(WorkerStatus.RUNNING)
        if PID_TAG not in run.tags:
            return CheckRunHealthResult(WorkerStatus.NOT_FOUND, "The run has no worker yet.")
        return CheckRunHealthResult(WorkerStatus.FAILED, f"Run worker {run.tags[PID_TAG]} is gone.")

    def join(self, timeout: int = 30) -> None:
        """Waits until every worker this launcher started has ended (tests)."""
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            (worker.join if hasattr(worker, "join") else worker.wait)(timeout)

    def dispose(self) -> None:
        """Stops watching (the workers go on: a run outlives the daemon that launched it)."""
        self._stopping.set()


def _exit_code(worker: Any) -> int | None:
    """A worker's exit code once it has ended, else None; negative: the signal that ended it."""
    return worker.exitcode if isinstance(worker, multiprocessing.process.BaseProcess) else worker.poll()

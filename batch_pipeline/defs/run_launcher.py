"""`ForkedRunLauncher`: Dagster's run launcher for one machine, each run's worker a fork of a warm process.

Dagster's default launcher asks the code server to start each run, and the code server starts a new
Python process for it: Python, Dagster and the pipeline are imported again before the run does anything
(about 1.5 CPU-s a run here, and most of a file run's start when three start at once on 2 cores;
docs/PERFORMANCE.md). On a warm engine a file run answers in about a second, so that start was most of
what it cost.

This launcher starts each run's worker as a fork of a warm process instead: Python's multiprocessing
fork server, started on the first launch, which imports defs/run_worker.py (Dagster's run execution
and the pipeline's wiring, never vLLM) once. The worker runs `dagster api execute_run`, as the run
workers of Dagster's container launchers (Docker, Kubernetes) do, and the run's event log says it was
forked (or started afresh, when the project's code changed since the fork server imported it: an edit
behaves as with the default launcher). A code location with another Python (its `executable_path`)
gets a new process of that Python. The fork server finds modules as a new `python -c` would (installed
packages, PYTHONPATH, the working directory; Python 3.11's does not take the daemon's sys.path): a worker
whose fork server could not import the pipeline imports it itself, and says so.

What the default launcher's code server does for its runs, this launcher does for its own:
- a worker that dies before its run finished fails the run, with Dagster's own wording of the exit
  (a thread looks every WATCH_SECONDS), so run retries and the Batch API see it as before;
- `terminate` (the UI's Terminate, the Batch API's cancel) interrupts the worker with SIGTERM, which a
  run worker takes as Ctrl-C: the run ends CANCELED, its answers kept;
- run monitoring may ask whether a worker lives (`check_run_worker_health`).
The worker is found by the run's PID_TAG (its pid and start time, so a reused pid is never signalled),
so the web server can terminate a run the daemon launched. That is why it serves instances whose daemon,
web server and runs share one machine: `dagster dev`, `make dev` and the tests (dagster.yaml). deploy/
keeps Dagster's launchers: the compose file's default launcher starts runs beside the code server, in the
container with the GPUs, and the Helm chart a Kubernetes pod per run. As with the default launcher, whose
code server forgets its runs when it restarts, a worker that dies while the daemon that launched it is
down is not noticed: terminate its run in the UI.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
log = logging.getLogger(__name__)


def _run_worker(argv: list[str]) -> None:
    """The forked worker's entry (run_worker.py is already imported here: the fork server's preload). It
    ends as a normal exit would (atexit handlers, threads), which a fork server's child otherwise skips."""
    try:
        from batch_pipeline.defs.run_worker import execute_run
    except Exception:  # noqa: BLE001 - the pipeline does not import: a new process says why in the run's log
        os.execv(argv[0], argv)
    from batch_pipeline.base.runtime import exit_without_teardown

    try:
        execute_run(argv)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    exit_without_teardown(code)


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot), or None when it is gone or /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process (forked) or subprocess.Popen (another Python)
    started: str | None  # process_start(pid) right after the start

    def exit_code(self) -> int | None:
        """Its exit code once it has ended, else None; negative: the signal that ended it. Only under the
        launcher's lock: two readers of a forked worker's status would get the code and an EOF (255)."""
        if isinstance(self.process, multiprocessing.process.BaseProcess):
            return self.process.exitcode
        return self.process.poll()

    def alive(self) -> bool:
        return self.started is not None and process_start(self.process.pid) == self.started

    def ended(self) -> int | None:
        """Its exit code once its process is gone, else None (a forked worker's code can be read while it
        still runs: when the fork server dies, it reads 255). Under the launcher's lock, as exit_code."""
        code = self.exit_code()
        return None if code is None or self.alive() else code


class ForkedRunLauncher(RunLauncher, ConfigurableClass):
    """Starts each run's worker as a fork of a process that has Dagster and the pipeline imported.
    `preload`: further modules the fork server imports (the code location's own, when it is not this
    project)."""

    def __init__(self, preload: Sequence[str] = (), inst_data: ConfigurableClassData | None = None) -> None:
        self._inst_data = inst_data
        self.preload = [WARM_MODULE, *preload]
        self._workers: dict[str, _Worker] = {}
        self._lock = threading.RLock()  # the workers, their starts and every read of their status
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
        with self._lock:
            process = self._start(run, argv)
            worker = self._workers[run.run_id] = _Worker(process, process_start(process.pid))
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="forked-run-watch", daemon=True)
                self._watcher.start()
        try:
            self._instance.add_run_tags(run.run_id, {PID_TAG: f"{process.pid}@{worker.started or ''}"})
        except Exception:  # noqa: BLE001 - the run goes on; only a terminate from another process misses it
            log.exception("could not tag run %s with its worker's pid %s", run.run_id, process.pid)

    def _start(self, run: dg.DagsterRun, argv: list[str]) -> Any:
        if self.forks(argv):
            try:
                process = self._fork_context().Process(target=_run_worker, args=(argv,), name=f"dagster run {run.run_id}")
                process.start()
                return process
            except Exception as e:  # noqa: BLE001 - e.g. the fork server died importing the pipeline
                self._instance.report_engine_event(
                    f"Could not fork the run's worker from the warm process ({e!r}): starting it as a new process.",
                    run, cls=self.__class__)
        return subprocess.Popen(argv)  # another Python: a new process of it, as Dagster's command-line launchers do

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
                ended = {run_id: (worker, code) for run_id, worker in self._workers.items()
                         if (code := worker.ended()) is not None}
                for run_id in ended:
                    del self._workers[run_id]
            for run_id, (worker, code) in ended.items():
                try:
                    self._worker_ended(run_id, code)
                except Exception:  # noqa: BLE001 - e.g. a locked database: look again next time
                    log.exception("could not record the end of run %s's worker", run_id)
                    with self._lock:
                        self._workers[run_id] = worker

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
        if not pid.isdigit() or not started:
            return None
        return int(pid) if process_start(int(pid)) == started else None

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
        except (ProcessLookupError, PermissionError):
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: dg.DagsterRun) -> CheckRunHealthResult:
        with self._lock:
            worker = self._workers.get(run.run_id)
            code = None if worker is None else worker.ended()
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(w.ended() is not None for w in self._workers.values()):
                    return
            time.sleep(0.1)

    def dispose(self) -> None:
        """Stops watching. The workers go on; a daemon's own exit waits for the forked ones, since
        multiprocessing joins a process's children at exit (as a code server waits for its runs)."""
        self._stopping.set()

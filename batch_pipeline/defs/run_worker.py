"""A run's worker forked from a warm process (`ForkedRunLauncher`, defs/run_launcher.py).

Importing this module imports what every run's worker needs before its run starts: Dagster's command
line and run execution, the instance's storages, and the pipeline's Dagster wiring with the steps,
contract and engine client beneath it (never vLLM or torch: an in-process run imports those in its
engine step, after the fork). The launcher's fork server imports it once; each run's worker is a fork of
that process and runs `dagster api execute_run` in it (`execute_run`), as a new process would, without
paying Python's start and those imports again (about 1.5 CPU-s a run here; docs/PERFORMANCE.md).

A fork runs the code the fork server imported. When one of this process's own source files (the
project's, not the interpreter's or installed packages') has changed since, the worker starts afresh
with the same command (`os.execv`), so an edit and a code location reload behave as with Dagster's
default launcher.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from pathlib import Path

IMPORTED_AT = time.time()  # before the imports below, so an edit made while they ran counts as newer

import dagster as dg  # noqa: E402
import dagster._cli  # noqa: E402  (the `dagster` command a run worker runs: `dagster api execute_run`)
import dagster._cli.api  # noqa: E402
import dagster._core.execution.api  # noqa: E402
import dagster._core.storage.sqlite_storage  # noqa: E402
from dagster._grpc.types import ExecuteRunArgs  # noqa: E402
from dagster._serdes import deserialize_value  # noqa: E402

import batch_pipeline.defs.alerts  # noqa: E402
import batch_pipeline.defs.assets  # noqa: E402
import batch_pipeline.defs.batch_files  # noqa: E402
import batch_pipeline.defs.date_figures  # noqa: E402
import batch_pipeline.defs.file_status  # noqa: E402
import batch_pipeline.defs.jobs  # noqa: E402
import batch_pipeline.defs.resources  # noqa: E402
import batch_pipeline.defs.run_watch  # noqa: E402
import batch_pipeline.defs.schedules  # noqa: E402
import batch_pipeline.defs.sensors  # noqa: E402

# Where the interpreter's own modules and installed packages live: their files are not the project's code.
_ROOTS = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
_INSTALLED = tuple(f"{root}{os.sep}" for root in _ROOTS | {root.resolve() for root in _ROOTS})
FORKED_MESSAGE = "Run worker forked from the warm process (pid {pid}): Dagster and the pipeline already imported."
FRESH_MESSAGE = "Run worker started afresh: {path} changed since the warm process imported it."


def project_files(modules: dict) -> list[str]:
    """The source files of `modules` that are the project's own (not the interpreter's or installed)."""
    files = []
    for module in list(modules.values()):
        path = getattr(module, "__file__", None)
        if path and not path.startswith(_INSTALLED) and not str(Path(path).resolve()).startswith(_INSTALLED):
            files.append(path)
    return files


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:  # gone
        return None
    return stat.st_mtime_ns, stat.st_size


def changed_since_imported(modules: dict | None = None, stamps: dict | None = None, since: float | None = None) -> str | None:
    """A source file of the project's modules in `modules` (default: this process's) that is not as it
    was when imported, or None: one whose modification time or size differs from `stamps` (taken when
    this module's imports were done), or one imported later that was modified after `since` (when this
    module's import began), or one that is gone."""
    stamps = STAMPS if stamps is None else stamps
    since = IMPORTED_AT if since is None else since
    for path in project_files(sys.modules if modules is None else modules):
        now = _stamp(path)
        if now is None or (now != stamps[path] if path in stamps else now[0] > since * 1e9):
            return path
    return None


STAMPS = {path: _stamp(path) for path in project_files(sys.modules)}
IMPORTED_IN = os.getpid()  # the fork server's pid; in a worker, its own pid if the fork server could not import this


def execute_run(argv: list[str]) -> None:
    """`dagster api execute_run ...` (`argv`, the run launcher's command) in this forked process, or in a
    fresh process of the same pid (the same command, `execv`) when the project's code changed since the fork server imported it.
    Either way the run's event log says which."""
    changed = changed_since_imported()
    args = deserialize_value(argv[-1], ExecuteRunArgs)
    if changed:
        message = FRESH_MESSAGE.format(path=changed)
    elif IMPORTED_IN == os.getpid():
        message = "Run worker forked, but the warm process had not imported the pipeline: imported here."
    else:
        message = FORKED_MESSAGE.format(pid=IMPORTED_IN)
    with dg.DagsterInstance.from_ref(args.instance_ref) as instance:
        run = instance.get_run_by_id(args.run_id)
        if run is not None:
            instance.report_engine_event(message, run)
    if changed:
        os.execv(argv[0], argv)
    sys.argv = ["dagster", *argv[argv.index("api"):]]
    dagster._cli.main()


__all__ = ["IMPORTED_AT", "STAMPS", "changed_since_imported", "execute_run", "project_files"]

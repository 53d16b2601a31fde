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

# Where the interpreter and installed packages live: their files are not the project's own code.
_INSTALLED = tuple({str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"])})
FORKED_MESSAGE = "Run worker forked from the warm process (pid {pid}): Dagster and the pipeline already imported."
FRESH_MESSAGE = "Run worker started afresh: {path} changed since the warm process imported it."


def changed_since_imported(modules: dict | None = None, since: float | None = None) -> str | None:
    """A source file of the project's own modules imported here that was modified after `since` (default:
    when this module was imported), or None."""
    since = IMPORTED_AT if since is None else since
    for module in list((sys.modules if modules is None else modules).values()):
        path = getattr(module, "__file__", None)
        if not path or path.startswith(_INSTALLED) or str(Path(path).resolve()).startswith(_INSTALLED):
            continue
        try:
            if os.stat(path).st_mtime > since:
                return path
        except OSError:  # a module whose file is gone: run the code that is there now
            return path
    return None


def execute_run(argv: list[str]) -> None:
    """`dagster api execute_run ...` (`argv`, the run launcher's command) in this forked process, or in a
    fresh process of the same pid (the same command, `execv`) when the project's code changed since the fork server imported it.
    Either way the run's event log says which."""
    changed = changed_since_imported()
    args = deserialize_value(argv[-1], ExecuteRunArgs)
    with dg.DagsterInstance.from_ref(args.instance_ref) as instance:
        run = instance.get_run_by_id(args.run_id)
        if run is not None:
            message = FRESH_MESSAGE.format(path=changed) if changed else FORKED_MESSAGE.format(pid=os.getppid())
            instance.report_engine_event(message, run)
    if changed:
        os.execv(argv[0], argv)
    sys.argv = ["dagster", *argv[argv.index("api"):]]
    dagster._cli.main()


__all__ = ["IMPORTED_AT", "changed_since_imported", "dg", "execute_run"]

"""The Dagster entry point (workspace.yaml): every definition under batch_pipeline/defs/."""

import multiprocessing
import sys
import warnings
from pathlib import Path

import dagster as dg

PROJECT = Path(__file__).parent
# The commands Dagster starts a run's worker with (`dagster api execute_run ...`: a run launcher's,
# a Kubernetes run pod's): a process that executes one run and never shows the UI anything.
RUN_WORKER_COMMANDS = {"execute_run", "resume_run", "execute_step"}


def in_a_run_worker(argv: list[str] | None = None, spawned: bool | None = None) -> bool:
    """A run's worker: started with one of RUN_WORKER_COMMANDS, or a multiprocessing child (a code
    server starts the runs it launches as such: `dagster dev`, the default run launcher). The code
    server itself, `dagster dev` and the CLI are none of these."""
    spawned = multiprocessing.parent_process() is not None if spawned is None else spawned
    return spawned or bool(RUN_WORKER_COMMANDS & set((sys.argv if argv is None else argv)[1:3]))


def defs_folder() -> dg.Definitions:
    """The defs folder's definitions. `load_from_defs_folder` also describes every installed plugin's
    component types (importing dagster_aws.components, ...) for the UI's component pages: 0.7-1.5 s
    of each run worker's start here, for metadata only the code server serves. A run worker builds
    the same folder without it (test_definitions checks both give the same definitions)."""
    if in_a_run_worker():
        # Dagster's own preview loaders inside build_defs warn (PreviewWarning, twice) where
        # load_from_defs_folder does not: every run's worker would print them to the run's stderr.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dg.PreviewWarning)
            return dg.ComponentTree.for_project(path_within_project=PROJECT).build_defs(PROJECT / "defs")
    return dg.load_from_defs_folder(path_within_project=PROJECT)


@dg.definitions
def defs() -> dg.Definitions:
    # In-process executor: the four steps are a straight line, and a process per step cost ~4-5 s
    # each (an empty date took 34 s with the multiprocess executor, 1 s in-process). Pools still apply.
    return dg.Definitions.merge(defs_folder(), dg.Definitions(executor=dg.in_process_executor))

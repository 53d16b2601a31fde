"""Two small Dagster jobs a run launcher's tests launch as real runs: `quick_job` ends at once;
`held_job` runs until its release file exists (or 120 s), so a test can kill or terminate its worker.
Their ops run in the run's worker (the in-process executor, as the pipeline's jobs do), so a killed
worker leaves no step process behind."""

import os
import time
from pathlib import Path

import dagster as dg


@dg.op
def say_pid(context: dg.OpExecutionContext) -> int:
    context.log.info(f"run worker pid {os.getpid()}")
    return os.getpid()


@dg.op(config_schema={"release": str})
def hold(context: dg.OpExecutionContext) -> None:
    release = Path(context.op_config["release"])
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


@dg.job(executor_def=dg.in_process_executor)
def quick_job() -> None:
    say_pid()


@dg.job(executor_def=dg.in_process_executor)
def held_job() -> None:
    hold()

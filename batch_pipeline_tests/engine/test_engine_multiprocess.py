"""The engine mode GPU users get, on the CPU: vLLM's engine core in its own process.

Off the CPU, vLLM runs its engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1, its
default); on the CPU the pipeline defaults to the in-process core, so the other tests never run that
mode. Here the real `batch-pipeline run` runs in a subprocess on the tiny model with
VLLM_ENABLE_V1_MULTIPROCESSING=1, and the tests watch its process tree (vLLM names its processes
`VLLM::EngineCore` and `VLLM::Worker` through setproctitle, a vLLM dependency):

- cancellation: SIGINT to the CLI process, and to its process group as Ctrl-C in a terminal sends
  it, mid-inference: a cancelled batch (batch_cancelled lines for the rest), a cancelled exit code,
  every line once, no engine process left: the pipeline shuts the engine core down when its step
  ends (it is gone before the results are printed) and the process exits within seconds (the
  recipes' 8-minute hang at exit);
- an engine core killed with SIGKILL mid-batch: the step fails, Dagster's retry of
  inference_results builds a new engine core and resumes from the checkpoints; the batch completes,
  every line answered once with its tokens by engine cores that ran in children of the CLI process,
  shut down with their step, and no engine process is left behind.

A run resumed after a cancellation is the same in either engine mode (the checkpoints are the
pipeline's): test_reliability.py covers it.

Each test has a CLI process of its own (a fresh vLLM import and engine, about 20-45 s on 2 busy
cores): multiprocess mode never reaches the session's shared in-process engines (support/engines.py).
The three runs start at once, in a module fixture (`interrupted`) that interrupts each as soon as
its first answer is checkpointed (their imports and loads overlap, and each run's paused engine
leaves the others the cores); each test then checks its own run's outcome.
Until the interruption, each run's engine processes are paused (SIGSTOP) half of the time from
when the model is loaded (see LONG_ENV).
Not covered here: the in-process variants of the same failures (test_reliability.py), GPUs,
tensor parallelism (more than one worker process) and the embedding engine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batch_pipeline_tests.support.cli_runs import (
    CliRun,
    InterruptedRun,
    answered_once,
    assert_engine_shut_down_with_its_step,
    assert_no_engine_process_left,
    interrupt_each_after_first_part,
    part_files,
    read_results,
    write_batch,
)
from batch_pipeline_tests.support import tiny_env, wait_for

ENGINE_CORE = "VLLM::EngineCore"
# A long enough inference to interrupt on 2 busy cores: 64 requests x 64 tokens one at a time
# (1-4 ms a token here, depending on the day's machine), each answer checkpointed as it comes, the
# engine paused half of the time until the interruption: it follows the first answer, with ~60
# requests left (1-2 answered when it landed, at a load of 10-20 on 2 cores). (At 32 x 96 without
# the pauses, on a fast day, the whole batch was answered before an interrupt landed, or before a
# starved test process saw the first checkpoint part; test_data_parallel.py interrupts 32 x 64 over
# two ranks.) What is left after the interruption is answered one at a time by the killed core's
# retry (at 192 tokens a request, as before, 67 s of it here at a load of 5-10).
LONG_LINES, LONG_TOKENS = 64, 64
LONG_ENV = {"BATCH_SIZE": "1", "CHECKPOINT_ANSWERS": "1"}
# With such a run, CliRun(throttle_engine=True) (see cli_runs.py): the engine processes are paused
# half of the time, so the CLI process checkpoints answers as they come.


def multiprocess_env(tiny_model_dir: Path, **extra: str) -> dict[str, str]:
    # PYTHONUNBUFFERED: stdout lines arrive when printed, so the time to exit after them is real.
    return tiny_env(tiny_model_dir, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONUNBUFFERED="1", **extra)


@dataclass
class LongRun(InterruptedRun):
    """A long run in multiprocess mode, interrupted after its first checkpoint part (see `interrupted`)."""

    cores_alive: list[str] = field(default_factory=list)  # engine core processes running when interrupted
    killed: list = field(default_factory=list)  # the engine core process SIGKILLed ("kill")
    signalled: float = 0.0  # time.monotonic() of the interruption


def sigint_process(long: LongRun) -> None:
    os.kill(long.run.proc.pid, signal.SIGINT)


def sigint_process_group(long: LongRun) -> None:
    os.killpg(long.run.proc.pid, signal.SIGINT)


def sigkill_engine_core(long: LongRun) -> None:
    # The engine core is seen (sampled every 0.1 s) by its first answer. Only the CLI process's own
    # child: a process the engine core forks carries its title for a while (its workers; on a fresh
    # clone 2 such processes were seen before the first answer, CI of f3146f1).
    long.killed = wait_for("the engine core process", lambda: long.run.engine_children(ENGINE_CORE), 10, interval=0.1,
                           on_timeout=lambda: f"processes seen: {long.run.titles}")
    if len(long.killed) == 1:
        long.killed[0].kill()  # SIGKILL, as the OOM killer or a crashed driver ends it


# kill -INT (and Dagster's termination) signal the CLI process only: the pipeline must stop its
# engine core. Ctrl-C in a terminal signals the whole process group, the engine core included.
INTERRUPTIONS = {"process": sigint_process, "process group": sigint_process_group, "kill": sigkill_engine_core}


@pytest.fixture(scope="module")
def interrupted(tiny_model_dir, tmp_path_factory):
    """The three long runs (SIGINT to the process, to its group, SIGKILL to its engine core), started
    at once and each interrupted as soon as its first checkpoint part is written; then the engine is
    no longer paused. The tests wait for the outcomes."""
    runs: dict[str, LongRun] = {}
    try:
        for target in INTERRUPTIONS:
            prefix = "kill" if target == "kill" else "int"
            folder = tmp_path_factory.mktemp(f"long-{prefix}")
            ids = [f"{prefix}-{i:02d}" for i in range(LONG_LINES)]
            out = folder / "out"
            run = CliRun(write_batch(folder / "in.jsonl", ids, LONG_TOKENS), out,
                         multiprocess_env(tiny_model_dir, **LONG_ENV), throttle_engine=True)
            runs[target] = LongRun(run, out, ids)
        def interrupt(target: str, long: LongRun) -> None:
            long.cores_alive = long.run.alive(ENGINE_CORE)
            long.signalled = time.monotonic()
            INTERRUPTIONS[target](long)
            long.run.stop_throttling()
            long.saved = sum(p.read_text().count("\n") for p in part_files(long.out))

        interrupt_each_after_first_part(runs, interrupt)
        yield runs
    finally:
        for long in runs.values():
            long.run.kill_everything()


@pytest.mark.parametrize("target", ["process", "process group"], ids=["kill -INT pid", "ctrl-c"])
def test_sigint_mid_inference_cancels_the_batch_and_stops_the_engine_core(target, interrupted):
    long = interrupted[target]
    run, out, ids = long.run, long.out, long.ids
    assert long.running_when_interrupted, "the run ended before it could be interrupted\n" + run.tail()
    assert long.cores_alive, f"no engine core process while inferring: {run.titles}"
    code = run.wait(timeout=300)

    # Cancelled, not retried: Dagster's RetryPolicy must not run the cancelled step again.
    assert code in (130, 2), f"exit code {code} after SIGINT\n{run.tail()}"
    assert run.line_at("already answered; resuming") is None, "the cancelled step was retried\n" + run.tail()
    outputs, errors, batch = read_results(out)
    assert batch["status"] == "cancelled" and batch["cancelled_at"], batch["status"]
    answered_once(outputs, errors, ids)
    assert outputs and errors, (len(outputs), len(errors))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert batch["request_counts"] == {"total": LONG_LINES, "completed": len(outputs), "failed": len(errors)}
    assert_no_engine_process_left(run)
    assert_engine_shut_down_with_its_step(run, ENGINE_CORE)
    assert run.exited_at - long.signalled < 120, "the cancelled run took long to end"


def test_engine_core_killed_mid_batch_is_retried_and_resumes(interrupted):
    long = interrupted["kill"]
    run, out, ids, saved = long.run, long.out, long.ids, long.saved
    assert long.running_when_interrupted, "the run ended before its engine core could be killed\n" + run.tail()
    assert len(long.killed) == 1, f"the one engine core process to kill: {run.titles}"
    [core] = long.killed

    # The step fails (no hang on the dead core) and Dagster's retry resumes in the same run.
    wait_for("the retry of inference_results after the engine core was killed",
             lambda: run.line_at("already answered; resuming") or run.proc.poll() is not None, 120, interval=0.1,
             on_timeout=run.tail)
    assert run.line_at("already answered; resuming") is not None, (
        f"the run ended (exit code {run.proc.poll()}) without a retry: had the engine core answered every "
        f"request before it was killed? ({saved} checkpointed then)\n{run.tail()}"
    )
    code = run.wait(timeout=600)
    assert code == 0, run.tail()
    outputs, errors, batch = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": LONG_LINES, "completed": LONG_LINES, "failed": 0}
    for o in outputs:  # the answers of engine cores in children of the CLI process
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == LONG_TOKENS
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]
    resumed = json.loads((out / "metrics.json").read_text())["resumed_requests"]
    assert saved <= resumed < LONG_LINES, (saved, resumed)
    cores = run.engine_children(ENGINE_CORE)  # children of the CLI process: the engine cores ran there
    assert len(cores) == 2 and core in cores, f"the retry builds a second engine core: {run.titles}"
    assert_no_engine_process_left(run)
    assert_engine_shut_down_with_its_step(run, ENGINE_CORE)

"""The engine mode GPU users get, on the CPU: vLLM's engine core in its own process.

Off the CPU, vLLM runs its engine core in a child process (VLLM_ENABLE_V1_MULTIPROCESSING=1, its
default); on the CPU the pipeline defaults to the in-process core, so the other tests never run that
mode. Here the real `batch-pipeline run` runs in a subprocess on the tiny model with
VLLM_ENABLE_V1_MULTIPROCESSING=1, and the tests watch its process tree (vLLM names its processes
`VLLM::EngineCore` and `VLLM::Worker` through setproctitle, a vLLM dependency):

- answers: a small batch completes, every line answered once, by an engine core that ran in a child
  of the CLI process; the pipeline shuts that core down when its step ends (it is gone before the
  results are printed) and the process exits within seconds (the recipes' 8-minute hang at exit);
- cancellation: SIGINT to the CLI process, and to its process group as Ctrl-C in a terminal sends
  it, mid-inference: a cancelled batch (batch_cancelled lines for the rest), a cancelled exit code,
  no engine process left, and the next run resumes and answers each line once;
- an engine core killed with SIGKILL mid-batch: the step fails, Dagster's retry of
  inference_results builds a new engine core and resumes from the checkpoints, each line is
  answered once and no engine process is left behind.

Each test starts its own CLI process (a fresh vLLM import and engine, about 20-45 s on 2 busy
cores): multiprocess mode never reaches the session's shared in-process engines (conftest.py).
In the tests that interrupt an engine, its processes are paused (SIGSTOP) half of the time from
when the model is loaded until the interruption (see LONG_ENV).
Not covered here: the in-process variants of the same failures (test_reliability.py), GPUs,
tensor parallelism (more than one worker process) and the embedding engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil  # a dependency of vLLM (both builds)
import pytest

from batch_pipeline_tests.conftest import TINY_NAME, tiny_env

CLI = Path(sys.executable).parent / "batch-pipeline"
ENGINE_CORE = "VLLM::EngineCore"
# Seconds from the "results in" line to the end of the process. The recipes measured about 3 s
# with the engine core shut down, and a hang of minutes without.
EXIT_AFTER_RESULTS = 20.0
# A long enough inference to interrupt on 2 busy cores: 32 requests x 320 tokens one at a time,
# 8-15 s of decoding, each answer checkpointed as it comes (the interruption follows the first).
LONG_LINES, LONG_TOKENS = 32, 320
LONG_ENV = {"BATCH_SIZE": "1", "CHECKPOINT_ANSWERS": "1"}
# With such a run, CliRun(throttle_engine=True): on 2 shared cores the engine core (busy while
# decoding, in many threads) otherwise starves the CLI process, which then collects the answers and
# writes their checkpoints in one burst once the engine is done, leaving nothing to interrupt (seen
# in CI with the engine at nice 19: 3 parts written when all 32 answers were done). Pausing the
# engine processes THROTTLE_STOPPED s in every THROTTLE_PERIOD s leaves the CLI both cores in those
# pauses, whatever the scheduler does. On a GPU, decoding leaves the CPU to the CLI process.
THROTTLE_PERIOD, THROTTLE_STOPPED = 0.3, 0.15


def chat_line(custom_id: str, max_tokens: int) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"question {custom_id}"}],
            "max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def write_batch(path: Path, ids: list[str], max_tokens: int) -> Path:
    path.write_text("\n".join(chat_line(i, max_tokens) for i in ids) + "\n")
    return path


def read_results(out: Path) -> tuple[list[dict], list[dict], dict]:
    outputs = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    return outputs, errors, json.loads((out / "batch.json").read_text())


def answered_once(outputs: list[dict], errors: list[dict], ids: list[str]) -> None:
    got = [r["custom_id"] for r in outputs + errors]
    assert sorted(got) == sorted(ids), "every custom_id exactly once"


def part_files(out: Path) -> list[Path]:
    folder = out / "_work" / "answers"
    return sorted(folder.glob("*/part-*.jsonl")) if folder.exists() else []


def wait_for(condition: Callable[[], object], timeout: float, what: str, run: "CliRun | None" = None) -> object:
    """Poll until `condition()` is true; fail naming `what` (and the CLI's last lines) on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    tail = f"\n--- CLI output (last lines) ---\n{run.tail()}" if run else ""
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{tail}")


class CliRun:
    """`batch-pipeline run` in its own session (process group), its output lines time-stamped as
    they arrive and its process tree sampled while it runs."""

    def __init__(self, batch: Path, out: Path, env: dict[str, str], throttle_engine: bool = False):
        self.lines: list[tuple[float, str, str]] = []  # (monotonic time, "out"/"err", text)
        self.processes: dict[int, psutil.Process] = {}  # every descendant seen
        self.titles: dict[int, str] = {}  # pid -> last process title seen
        self.parents: dict[int, int] = {}
        self.last_alive: dict[int, float] = {}  # pid -> when last seen running (not a zombie)
        self.exited_at: float | None = None
        self.loads = 0  # "model ... loaded in" lines so far
        self.throttle_engine = throttle_engine
        self._throttle_lock = threading.Lock()
        self.proc = subprocess.Popen(
            [str(CLI), "run", str(batch), "--output-dir", str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True),
                         threading.Thread(target=self._watch, daemon=True),
                         threading.Thread(target=self._throttle, daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, stream, name: str) -> None:
        for text in stream:
            self.lines.append((time.monotonic(), name, text.rstrip("\n")))
            if " model " in text and " loaded in " in text:
                self.loads += 1

    def _watch(self) -> None:
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            try:
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            now = time.monotonic()
            for child in children:
                try:
                    title = " ".join(child.cmdline()).strip()
                    self.parents.setdefault(child.pid, child.ppid())
                    running = child.status() != psutil.STATUS_ZOMBIE
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                self.processes.setdefault(child.pid, child)
                if title or child.pid not in self.titles:  # an exiting process reads as ""
                    self.titles[child.pid] = title
                if running:
                    self.last_alive[child.pid] = now
            time.sleep(0.1)
        self.exited_at = time.monotonic()

    def _throttle(self) -> None:
        """While `throttle_engine` holds and a model is loaded, stop every engine process (SIGSTOP)
        for THROTTLE_STOPPED seconds out of each THROTTLE_PERIOD, so the CLI process gets both cores
        regularly and checkpoints answers as they come instead of in one burst at the end."""
        while self.proc.poll() is None and self.throttle_engine:
            if not self.loads:
                time.sleep(0.05)
                continue
            with self._throttle_lock:
                if not self.throttle_engine:
                    break
                self._signal_engine(signal.SIGSTOP)
            time.sleep(THROTTLE_STOPPED)
            with self._throttle_lock:
                self._signal_engine(signal.SIGCONT)
            time.sleep(THROTTLE_PERIOD - THROTTLE_STOPPED)

    def _signal_engine(self, sig: int) -> None:
        for p in self.engine_processes():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop_throttling(self) -> None:
        """Let the engine processes run freely again (shutdown and a rebuilt engine run unhindered)."""
        with self._throttle_lock:
            self.throttle_engine = False
            self._signal_engine(signal.SIGCONT)

    # -- what was seen ------------------------------------------------------------------------

    def engine_processes(self, title: str = "VLLM::") -> list[psutil.Process]:
        return [self.processes[pid] for pid, t in list(self.titles.items()) if t.startswith(title)]

    def alive(self, title: str = "VLLM::") -> list[str]:
        """Engine processes seen during the run that still exist (zombies count as gone)."""
        left = []
        for p in self.engine_processes(title):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {self.titles[p.pid]}")
            except psutil.NoSuchProcess:
                continue
        return left

    def line_at(self, fragment: str) -> float | None:
        return next((t for t, _, text in self.lines if fragment in text), None)

    def text(self, stream: str) -> str:
        return "\n".join(text for _, name, text in self.lines if name == stream)

    def tail(self) -> str:
        noise = ("dagster - DEBUG", "Triton", "FutureWarning", "NUMA", "safetensors")
        return "\n".join(f"[{name}] {text}" for _, name, text in self.lines
                         if text.strip() and not any(x in text for x in noise))[-6000:]

    # -- control ------------------------------------------------------------------------------

    def wait(self, timeout: float) -> int:
        """Wait for the process to end; when it printed its results, it gets EXIT_AFTER_RESULTS more
        seconds at most (a hang at exit fails fast instead of using up `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            printed = self.line_at("results in ")
            if printed is not None and time.monotonic() - printed > EXIT_AFTER_RESULTS:
                pytest.fail(
                    f"the CLI printed its results but had not exited {EXIT_AFTER_RESULTS:.0f}s later "
                    f"(engine processes alive: {self.alive()}): the engine core was not shut down?\n{self.tail()}"
                )
            time.sleep(0.1)
        if self.proc.poll() is None:
            pytest.fail(f"the CLI did not finish within {timeout:.0f}s\n{self.tail()}")
        for t in self._threads:
            t.join(timeout=10)
        return self.proc.returncode

    def seconds_from_results_to_exit(self) -> float:
        printed = self.line_at("results in ")
        assert printed is not None and self.exited_at is not None, self.tail()
        return self.exited_at - printed

    def kill_everything(self) -> None:
        """Cleanup: the CLI's process group and every engine process seen (all started by this test)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        for p in self.engine_processes():
            try:
                if p.is_running():
                    p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def cli_runs():
    """Starts CLI runs and kills whatever is left of them when the test ends, passed or not."""
    runs: list[CliRun] = []

    def start(batch: Path, out: Path, env: dict[str, str], **options: bool) -> CliRun:
        runs.append(CliRun(batch, out, env, **options))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_everything()


def multiprocess_env(tiny_model_dir: Path, **extra: str) -> dict[str, str]:
    # PYTHONUNBUFFERED: stdout lines arrive when printed, so the time to exit after them is real.
    return tiny_env(tiny_model_dir, VLLM_ENABLE_V1_MULTIPROCESSING="1", PYTHONUNBUFFERED="1", **extra)


def assert_engine_shut_down_with_its_step(run: CliRun) -> None:
    """The engine cores ended before the CLI printed its results (the pipeline shut them down when
    the step ended, not vLLM's finalizers at interpreter exit: measured here, exit then takes ~8 s
    instead of ~3 s, and the recipes saw a hang of 8 minutes), and the process exited soon after.
    (Last seen running at most 1 s after the line: sampling is every 0.1 s.)"""
    printed = run.line_at("results in ")
    assert printed is not None, run.tail()
    last_alive = {p.pid: run.last_alive.get(p.pid, 0.0) for p in run.engine_processes(ENGINE_CORE)}
    late = {f"{pid} {ENGINE_CORE}": round(t - printed, 1) for pid, t in last_alive.items() if t > printed + 1.0}
    assert not late, f"engine cores still running this many seconds after the results were printed: {late}"
    took = run.seconds_from_results_to_exit()
    assert took < EXIT_AFTER_RESULTS, f"exited {took:.1f}s after printing its results"


def assert_no_engine_process_left(run: CliRun) -> None:
    # A worker notices its engine core's death through a pipe: give it a moment.
    deadline = time.monotonic() + 10
    while run.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not run.alive(), f"engine processes outlived the CLI: {run.alive()}"


def test_answers_from_an_engine_core_in_a_child_process_and_a_prompt_exit(tiny_model_dir, tmp_path, cli_runs):
    ids = [f"mp-{i:02d}" for i in range(20)]
    out = tmp_path / "out"
    run = cli_runs(write_batch(tmp_path / "in.jsonl", ids, max_tokens=16), out, multiprocess_env(tiny_model_dir))
    code = run.wait(timeout=600)
    assert code == 0, run.tail()

    outputs, errors, batch = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    for o in outputs:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == 16
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"]

    cores = run.engine_processes(ENGINE_CORE)
    assert len(cores) == 1, f"one engine core process expected, saw {run.titles}"
    assert run.parents[cores[0].pid] == run.proc.pid, "the engine core is a child of the CLI process"
    assert_no_engine_process_left(run)
    assert_engine_shut_down_with_its_step(run)


@pytest.mark.parametrize(
    "target,then_resume",
    # kill -INT (and Dagster's termination) signal the CLI process only: the pipeline must stop its
    # engine core. Ctrl-C in a terminal signals the whole process group, the engine core included.
    # Resuming is the same after both: checked once.
    [("process", False), ("process group", True)],
    ids=["kill -INT pid", "ctrl-c"],
)
def test_sigint_mid_inference_cancels_and_the_next_run_resumes(target, then_resume, tiny_model_dir, tmp_path, cli_runs):
    ids = [f"int-{i:02d}" for i in range(LONG_LINES)]
    batch_file = write_batch(tmp_path / "in.jsonl", ids, LONG_TOKENS)
    out = tmp_path / "out"
    env = multiprocess_env(tiny_model_dir, **LONG_ENV)
    run = cli_runs(batch_file, out, env, throttle_engine=True)
    wait_for(lambda: part_files(out) or run.proc.poll() is not None, 600, "the first checkpoint part", run)
    assert run.proc.poll() is None, "the run ended before it could be interrupted\n" + run.tail()
    assert run.alive(ENGINE_CORE), f"no engine core process while inferring: {run.titles}"
    signalled = time.monotonic()
    if target == "process":
        os.kill(run.proc.pid, signal.SIGINT)
    else:
        os.killpg(run.proc.pid, signal.SIGINT)
    run.stop_throttling()
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
    assert_engine_shut_down_with_its_step(run)
    assert run.exited_at - signalled < 120, "the cancelled run took long to end"
    if not then_resume:
        return

    second = cli_runs(batch_file, out, env)
    assert second.wait(timeout=600) == 0, second.tail()
    assert f"{len(outputs)} of {LONG_LINES} requests already answered; resuming" in second.text("err")
    outputs2, errors2, batch2 = read_results(out)
    answered_once(outputs2, errors2, ids)
    assert errors2 == [] and batch2["status"] == "completed"
    kept = {o["custom_id"]: o["response"]["body"]["choices"] for o in outputs}
    assert all(o["response"]["body"]["choices"] == kept[o["custom_id"]] for o in outputs2 if o["custom_id"] in kept)
    assert json.loads((out / "metrics.json").read_text())["resumed_requests"] == len(outputs)
    assert_no_engine_process_left(second)
    assert_engine_shut_down_with_its_step(second)


def test_engine_core_killed_mid_batch_is_retried_and_resumes(tiny_model_dir, tmp_path, cli_runs):
    ids = [f"kill-{i:02d}" for i in range(LONG_LINES)]
    out = tmp_path / "out"
    run = cli_runs(write_batch(tmp_path / "in.jsonl", ids, LONG_TOKENS), out,
                   multiprocess_env(tiny_model_dir, **LONG_ENV), throttle_engine=True)
    wait_for(lambda: part_files(out) or run.proc.poll() is not None, 600, "the first checkpoint part", run)
    assert run.proc.poll() is None, "the run ended before its engine core could be killed\n" + run.tail()
    [core] = wait_for(lambda: run.engine_processes(ENGINE_CORE), 10, "the engine core process", run)
    core.kill()  # SIGKILL, as the OOM killer or a crashed driver ends it
    run.stop_throttling()
    saved = sum(len(p.read_text().splitlines()) for p in part_files(out))

    # The step fails (no hang on the dead core) and Dagster's retry resumes in the same run.
    wait_for(lambda: run.line_at("already answered; resuming") or run.proc.poll() is not None, 120,
             "the retry of inference_results after the engine core was killed", run)
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
    resumed = json.loads((out / "metrics.json").read_text())["resumed_requests"]
    assert saved <= resumed < LONG_LINES, (saved, resumed)
    cores = run.engine_processes(ENGINE_CORE)
    assert len(cores) == 2 and core in cores, f"the retry builds a second engine core: {run.titles}"
    assert_no_engine_process_left(run)
    assert_engine_shut_down_with_its_step(run)

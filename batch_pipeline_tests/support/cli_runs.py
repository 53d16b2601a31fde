"""`batch-pipeline run` as a user starts it, watched from outside: its output lines time-stamped,
its process tree sampled (engine cores, data-parallel ranks), and its engine processes paused on
demand so that a test can interrupt a batch mid-way on 2 shared cores. Used by the tests that
run the CLI in its own process (test_engine_multiprocess.py, test_data_parallel.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import psutil  # a dependency of vLLM (both builds)
import pytest

from batch_pipeline_tests.support import TINY_NAME, wait_for

CLI = Path(sys.executable).parent / "batch-pipeline"
# Seconds from the "results in" line to the end of the process. The recipes measured about 3 s
# with the engine core shut down, and a hang of minutes without.
EXIT_AFTER_RESULTS = 20.0
# CliRun(throttle_engine=True): with a long batch on 2 shared cores the engine core (busy while
# decoding, in many threads) otherwise starves the CLI process, which then collects the answers and
# writes their checkpoints in one burst once the engine is done, leaving nothing to interrupt (seen
# in CI with the engine at nice 19: 3 parts written when all 32 answers were done). Pausing the
# engine processes THROTTLE_STOPPED s in every THROTTLE_PERIOD s leaves the CLI both cores in those
# pauses, whatever the scheduler does. On a GPU, decoding leaves the CPU to the CLI process.
THROTTLE_PERIOD, THROTTLE_STOPPED = 0.3, 0.15


def chat_line(custom_id: str, max_tokens: int, **sampling: float) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"question {custom_id}"}],
            "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def write_batch(path: Path, ids: list[str], max_tokens: int, **sampling: float) -> Path:
    path.write_text("\n".join(chat_line(i, max_tokens, **sampling) for i in ids) + "\n")
    return path


def jsonl_records(text: str) -> list[dict]:
    """The records of a JSON Lines text, split on "\n" only: the random tiny model's answers hold
    U+2028 and other line breaks, which str.splitlines would split inside a JSON string."""
    return [json.loads(line) for line in text.split("\n") if line]


def read_results(out: Path) -> tuple[list[dict], list[dict], dict]:
    outputs = jsonl_records((out / "output.jsonl").read_text())
    errors = jsonl_records((out / "errors.jsonl").read_text())
    return outputs, errors, json.loads((out / "batch.json").read_text())


def answered_once(outputs: list[dict], errors: list[dict], ids: list[str | None]) -> None:
    """Every custom_id exactly once across output and error lines (None: a line without one)."""
    got = [r["custom_id"] for r in outputs + errors]
    assert sorted(got, key=str) == sorted(ids, key=str), "every custom_id exactly once"


def part_files(out: Path) -> list[Path]:
    folder = out / "_work" / "answers"
    return sorted(folder.glob("*/part-*.jsonl")) if folder.exists() else []


@dataclass
class InterruptedRun:
    """A long `batch-pipeline run` started to be interrupted mid-batch (interrupt_each_after_first_part)."""

    run: "CliRun"
    out: Path
    ids: list[str]
    running_when_interrupted: bool = False  # False: it ended before it could be interrupted
    saved: int = 0  # answers checkpointed when interrupted


def interrupt_each_after_first_part(runs: dict[str, Any], interrupt: Callable[[str, Any], None],
                                    timeout: float = 600) -> None:
    """Runs started at once (InterruptedRun values): as soon as one's first checkpoint part is written,
    `interrupt(name, value)` if it is still running. Sets each one's `running_when_interrupted`."""
    waiting = dict(runs)

    def each_interrupted() -> bool:
        for name, long in list(waiting.items()):
            if part_files(long.out) or long.run.proc.poll() is not None:
                long.running_when_interrupted = long.run.proc.poll() is None
                if long.running_when_interrupted:
                    interrupt(name, long)
                del waiting[name]
        return not waiting

    wait_for("the first checkpoint part of each run", each_interrupted, timeout, interval=0.1,
             on_timeout=lambda: "\n".join(f"--- {name} ---\n{long.run.tail()}" for name, long in waiting.items()))


def killed_after_parts(command: list[str], env: dict[str, str], out: Path, parts: int = 2,
                       timeout: float = 300) -> int:
    """Start the CLI `command`, SIGKILL its whole process group once `parts` checkpoint parts are
    in `out`, and return how many answers those parts hold. Fails if the run ended first."""
    victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(f"{parts} checkpoint parts in {out}", lambda: len(part_files(out)) >= parts or victim.poll() is not None,
                 timeout, interval=0.2, on_timeout=lambda: f"{len(part_files(out))} parts so far")
        assert victim.poll() is None, "the run finished before it could be killed: make the workload bigger"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    return sum(p.read_text().count("\n") for p in part_files(out))


class CliRun:
    """`batch-pipeline run` in its own session (process group), its output lines time-stamped as
    they arrive and its process tree sampled while it runs."""

    def __init__(self, batch: Path, out: Path, env: dict[str, str], throttle_engine: bool = False,
                 engine_title: str = "VLLM::"):
        self.lines: list[tuple[float, str, str]] = []  # (monotonic time, "out"/"err", text)
        self.processes: dict[int, psutil.Process] = {}  # every descendant seen
        self.titles: dict[int, str] = {}  # pid -> last process title seen
        self.parents: dict[int, int] = {}
        self.last_alive: dict[int, float] = {}  # pid -> when last seen running (not a zombie)
        self.exited_at: float | None = None
        self.loads = 0  # "model ... loaded in" lines so far
        self.throttle_engine = throttle_engine
        self.engine_title = engine_title  # process titles that count as engine processes
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
            time.sleep(0.1)  # the sampling interval of this watcher thread
        self.exited_at = time.monotonic()

    def _throttle(self) -> None:
        """While `throttle_engine` holds and a model is loaded, stop every engine process (SIGSTOP)
        for THROTTLE_STOPPED seconds out of each THROTTLE_PERIOD, so the CLI process gets both cores
        regularly and checkpoints answers as they come instead of in one burst at the end."""
        while self.proc.poll() is None and self.throttle_engine:
            if not self.loads:
                time.sleep(0.05)  # the poll interval of this thread's loop, until a model is loaded
                continue
            with self._throttle_lock:
                if not self.throttle_engine:
                    break
                self._signal_engine(signal.SIGSTOP)
            time.sleep(THROTTLE_STOPPED)  # the throttle's duty cycle (see THROTTLE_PERIOD)
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

    def engine_processes(self, title: str | None = None) -> list[psutil.Process]:
        title = self.engine_title if title is None else title
        return [self.processes[pid] for pid, t in list(self.titles.items()) if t.startswith(title)]

    def engine_children(self, title: str | None = None) -> list[psutil.Process]:
        """The engine processes the run started (ranks, engine cores): not those an engine process
        forked, which carry its title until they set their own or exec something else. A rank's
        parent is the ranks' fork server (engine/ranks.py), an engine core's the CLI process."""
        engines = {p.pid for p in self.engine_processes(title)}
        return [p for p in self.engine_processes(title) if self.parents.get(p.pid) not in engines]

    def alive(self, title: str | None = None) -> list[str]:
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
        def ended() -> bool:
            if self.proc.poll() is not None:
                return True
            printed = self.line_at("results in ")
            if printed is not None and time.monotonic() - printed > EXIT_AFTER_RESULTS:
                pytest.fail(
                    f"the CLI printed its results but had not exited {EXIT_AFTER_RESULTS:.0f}s later "
                    f"(engine processes alive: {self.alive()}): the engine core was not shut down?\n{self.tail()}"
                )
            return False

        wait_for("the CLI to finish", ended, timeout, interval=0.1, on_timeout=self.tail)
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

    def start(batch: Path, out: Path, env: dict[str, str], **options: Any) -> CliRun:
        runs.append(CliRun(batch, out, env, **options))
        return runs[-1]

    yield start
    for run in runs:
        run.kill_everything()


def assert_engine_shut_down_with_its_step(run: CliRun, title: str) -> None:
    """The engine processes (`title`) ended before the CLI printed its results (the pipeline shut them down when
    the step ended, not vLLM's finalizers at interpreter exit: measured here, exit then takes ~8 s
    instead of ~3 s, and the recipes saw a hang of 8 minutes), and the process exited soon after.
    (Last seen running at most 1 s after the line: sampling is every 0.1 s.)"""
    printed = run.line_at("results in ")
    assert printed is not None, run.tail()
    last_alive = {p.pid: run.last_alive.get(p.pid, 0.0) for p in run.engine_processes(title)}
    late = {f"{pid} {title}": round(t - printed, 1) for pid, t in last_alive.items() if t > printed + 1.0}
    assert not late, f"engine processes still running this many seconds after the results were printed: {late}"
    took = run.seconds_from_results_to_exit()
    assert took < EXIT_AFTER_RESULTS, f"exited {took:.1f}s after printing its results"


def assert_no_engine_process_left(run: CliRun) -> None:
    # A worker notices its engine core's death through a pipe: give it a moment.
    wait_for("the engine processes gone after the CLI", lambda: not run.alive(), 10, interval=0.2,
             on_timeout=lambda: f"engine processes outlived the CLI: {run.alive()}")

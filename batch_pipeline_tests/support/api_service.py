"""The Batch API service for tests: `batch-pipeline serve` in its own process over a real `dagster dev`.

`Serve` runs one `batch-pipeline serve` on a free port (stdout and stderr to one log, or stdout to a
file of its own: the audit log's stdout form), `service_stack` starts a `dagster dev` on an
instance's settings (the repo's dagster.yaml unless given) and the service over it, and the rest
drives and reads them: the openai SDK on a key, a request line (and one the run refuses), the
Dagster runs of a batch, and `lower_priority` for a run that only holds a run slot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from batch_pipeline_tests.support import TINY_NAME
from batch_pipeline_tests.support.dagster_server import DagsterDev, free_port, pipeline_env, start_dagster_dev
from batch_pipeline_tests.support import REPO, wait_for

RUN_TIMEOUT = 300.0  # create to a run's change of status: the daemon's queue and a run worker on 2 loaded cores


def request_line(custom_id: str, content: str | None = None, max_tokens: int = 4) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": content or f"say {custom_id}"}],
            "max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def refused_line(custom_id: str) -> str:
    """A request line the run refuses (its messages are not a list). A batch of only such lines takes a
    queue slot and a run worker like any other, then its run ends at validation (no valid lines: the
    batch and its run fail) without importing vLLM or loading the model: ~17 CPU-s less a run on these
    cores. For the runs whose start is what a test checks, not their answers."""
    line = json.loads(request_line(custom_id))
    line["body"]["messages"] = "not a list"
    return json.dumps(line)


def serve_env(extra: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with `extra` added (None: unset)."""
    merged = {**os.environ, **extra}
    return {k: v for k, v in merged.items() if v is not None}


class Serve:
    """One `batch-pipeline serve` on a free port; `stdout_path` keeps its stdout apart from its log."""

    def __init__(self, env: dict[str, str], log_path: Path, stdout_path: Path | None = None) -> None:
        self.env, self.log_path, self.stdout_path = env, log_path, stdout_path
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Serve":
        with contextlib.ExitStack() as files:
            log = files.enter_context(open(self.log_path, "ab"))
            out = files.enter_context(open(self.stdout_path, "ab")) if self.stdout_path else log
            self.process = subprocess.Popen(
                [str(Path(sys.executable).with_name("batch-pipeline")), "serve", "--port", str(self.port)],
                cwd=REPO, env=self.env, stdout=out, stderr=log if self.stdout_path else subprocess.STDOUT,
                start_new_session=True)
        wait_for("batch-pipeline serve healthy", self._healthy, 60, interval=0.5)
        return self

    def _healthy(self) -> bool | None:
        if self.process.poll() is not None:
            raise RuntimeError(f"batch-pipeline serve exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                return r.status == 200 or None
        except OSError:
            return None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)


@contextlib.contextmanager
def service_stack(root: Path, tiny_model_dir: Path, serve_extra: dict[str, str | None],
                  instance_yaml: Path | None = None, stdout_path: Path | None = None,
                  pipeline_extra: dict[str, str] | None = None, engine_url: str | None = None) -> Iterator[dict[str, Any]]:
    """A `dagster dev` (instance settings `instance_yaml`, default the repo's dagster.yaml: SQLite, the
    queued run coordinator) and `batch-pipeline serve` over it with `serve_extra` added to its
    environment (`pipeline_extra`: added to both, e.g. MODELS_FILE): {"url", "server", "serve", "out",
    "log", "env" (the service's variables)}. `engine_url`: the runs' warm engine (none: in-process)."""
    inbox, out = root / "in", root / "out"
    inbox.mkdir(parents=True)
    env = {**pipeline_env(tiny_model_dir, str(inbox), str(out), engine_url), **(pipeline_extra or {})}
    with contextlib.ExitStack() as stack:
        server = start_dagster_dev(root / "home", env, root / "dagster-dev.log", instance_yaml=instance_yaml)
        stack.callback(server.stop)
        serve = {**env, "DAGSTER_HOME": str(root / "home"), "DAGSTER_WEBSERVER_URL": server.url, **serve_extra}
        api = Serve(serve_env(serve), root / "serve.log", stdout_path)
        stack.callback(api.stop)
        api.start()
        yield {"url": f"{api.base}/v1", "server": server, "serve": api, "out": out, "log": api.log_path,
               "env": serve}


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def upload(sdk: openai.OpenAI, lines: list[str], name: str = "batch.jsonl") -> Any:
    return sdk.files.create(file=(name, ("\n".join(lines) + "\n").encode()), purpose="batch")


def batch_runs(server: DagsterDev, batch_id: str) -> list[dict[str, Any]]:
    """The Dagster runs of an API batch, newest first: runId, status, tags (a dict)."""
    runs = server.graphql(
        """query($f: RunsFilter) { runsOrError(filter: $f) { ... on Runs { results { runId status tags { key value } } } } }""",
        {"f": {"tags": [{"key": "batch_pipeline/api_batch_id", "value": batch_id}]}})["runsOrError"]["results"]
    return [{**run, "tags": {t["key"]: t["value"] for t in run["tags"]}} for run in runs]


def run_status(server: DagsterDev, batch_id: str) -> str:
    """The Dagster status of the batch's (newest) run."""
    return batch_runs(server, batch_id)[0]["status"]


def wait_run_status(server: DagsterDev, batch_id: str, statuses: tuple[str, ...], timeout: float = RUN_TIMEOUT) -> str:
    return wait_for(f"batch {batch_id}'s run {' or '.join(statuses)}",
                    lambda: (s := run_status(server, batch_id)) in statuses and s, timeout, interval=0.5,
                    on_timeout=server.log_tail)


def run_worker_pid(server: DagsterDev, run_id: str) -> int | None:
    """The pid of the run's worker process, from the engine event its worker reports when it starts."""
    import dagster as dg

    for entry in server.instance().all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        found = re.match(r"Started process for run \(pid: (\d+)\)", entry.message or "")
        if found:
            return int(found.group(1))
    return None


def lower_priority(server: DagsterDev, batch_id: str) -> None:
    """Nice 19 for the batch's started run: every thread of its worker process and of its children
    (threads and processes started later inherit it). For a long run that only holds a run slot, so
    the runs a test watches get the 2 cores; the run itself is unchanged, only scheduled after them."""
    import psutil

    run_id = batch_runs(server, batch_id)[0]["runId"]
    pid = wait_for(f"the worker pid of run {run_id}", lambda: run_worker_pid(server, run_id), 60, interval=0.5,
                   on_timeout=server.log_tail)
    worker = psutil.Process(pid)
    for process in [worker, *worker.children(recursive=True)]:
        for thread in process.threads():
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, thread.id, 19)

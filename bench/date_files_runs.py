#!/usr/bin/env python3
"""A date of several files as one date run, as file runs in-process, and as file runs on one warm engine.

A script, not a test. From the repository root:

    nice -n 10 .venv/bin/python bench/date_files_runs.py                 # 4 files, 16 documents x 8 questions, 2 rounds
    nice -n 10 .venv/bin/python bench/date_files_runs.py --files 2 --num-docs 4 --questions-per-doc 2 --rounds 1  # smoke
    # a candidate pipeline (e.g. a patched clone) for every run:
    PYTHONPATH=/tmp/stable_clone nice -n 10 .venv/bin/python bench/date_files_runs.py --pipeline-src /tmp/stable_clone

Issue #38 makes every batch file of a date its own run (asset batch_files, partition <date>/<name>,
batch_file_job). Its target: the date_files workload (bench/date_files.py: documents x questions,
shuffled and dealt out over --files files of one date) as file runs on a warm engine within 1.1x of
today's single date run, and at least 1.4x faster than file runs in-process. Four systems, side by
side in one invocation, the rounds rotating their order:

    date_run             the date as one run (date_files.py's `planned`): the four batch assets of the
                         date partition in one fresh process, one model load, one plan over every file;
    file_runs_inprocess  each file its own run, one after another: a fresh process per file
                         materializing batch_files for <date>/<name>, each loading the model;
    file_runs_warm       each file its own run, all started together (a fresh process per file, ENGINE_URL
                         set: no vLLM imported), answered by ONE vLLM OpenAI-compatible server started
                         before the rounds and not timed (engine/server.py's command), its prefix cache
                         reset (POST /reset_prefix_cache, VLLM_SERVER_DEV_MODE=1) before every timed use;
    date_run_warm        the date as one run (as date_run) on that warm engine: what the server path costs
                         by itself, apart from cutting the date into file runs.

Engine settings, the same for all: date_files.py's (MAX_MODEL_LEN 2048, a 256 MiB KV cache, prefix
caching on), as the pipeline's variables for the in-process runs and as the server's flags (the same
engine_kwargs turned into flags). vLLM's scheduler defaults differ by entry point (on CPU the LLM class
takes 256 sequences / 4096 tokens per step, the server 128 / 2048); --server-scheduler match (default)
gives the server the LLM class's, `default` leaves the server's own. ORDER=planned everywhere.

Wall time: date_run spawn to exit; file_runs_inprocess from the first spawn to the last exit (the runs
back to back); file_runs_warm from the spawn of all to the last exit. Every file must have all its lines
answered (batch.json, output.jsonl), else the script stops. Printed: wall time per system and round,
medians, file_runs_warm / date_run, file_runs_inprocess / file_runs_warm, and the prefix-cache hit rate
(cached prompt tokens / prompt tokens over the files' batch.json usage). The timed part holds an
exclusive flock on --lock (/tmp/bench.lock), shared with other benchmarks on this machine.

The pipeline the runs use: a `git archive` export of --pipeline-rev (default HEAD, so edits made to
the working tree while this runs do not reach it; `worktree` for the tree itself), or --pipeline-src DIR
(a folder holding batch_pipeline/), put first on every run's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_CACHE, REPO, add_engine_options, apply_engine_settings, bench_lock, child_env, chosen_systems, export_revision, loadavg, measure,
    medians, preflight, read_outputs, rotating_rounds, say,
)
from dates import DATE, DATE_RUN_CHILD, add_date_options, date_figures, run_date, write_date  # noqa: E402
from warm_server import WarmServer, start_like_runs  # noqa: E402

SYSTEMS = ("date_run", "file_runs_inprocess", "file_runs_warm", "date_run_warm")
WARM_SYSTEMS = ("file_runs_warm", "date_run_warm")  # answered by the one warm engine
DATE_SYSTEMS = ("date_run", "date_run_warm")  # the date as one run
# vLLM 0.32's CPU scheduler defaults for the LLM class (what an in-process run gets; arg_utils.get_batch_defaults).
LLM_CLASS_SCHEDULER = ["--max-num-seqs", "256", "--max-num-batched-tokens", "4096"]

# A file run: batch_files for <date>/<name> (what batch_file_job runs), on an ephemeral instance.
FILE_CHILD = r"""
import os, sys
import dagster as dg
import batch_pipeline
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.partitions import batch_file_partitions
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
print("batch_pipeline from", os.path.dirname(batch_pipeline.__file__), "ENGINE_URL", os.environ.get("ENGINE_URL"), flush=True)
inbox, out, key = sys.argv[1:4]
instance = dg.DagsterInstance.ephemeral()
instance.add_dynamic_partitions(batch_file_partitions.name, [key])
result = dg.materialize([batch_files], partition_key=key, instance=instance, raise_on_error=False,
                        resources={"batch": BatchSelection(), "llm": LLMResource(),
                                   "storage": StorageResource(input_path=inbox, output_path=out)})
sys.stdout.flush(); sys.stderr.flush()
os._exit(0 if result.success else 1)
"""


def pipeline_source(args: argparse.Namespace, work: Path) -> Path:
    """The folder holding the batch_pipeline package every run imports."""
    if args.pipeline_src:
        src = args.pipeline_src.resolve()
        if not (src / "batch_pipeline" / "__init__.py").exists():
            raise SystemExit(f"--pipeline-src {src}: no batch_pipeline/ package there")
        return src
    if args.pipeline_rev == "worktree":
        return REPO
    return export_revision(args.pipeline_rev, work)[1]


def check_outputs(system: str, out: Path, names: list[str], lines: dict[str, int], logs: list[str]) -> dict[str, Any]:
    """Every file answered in full (output.jsonl and batch.json); the date's figures (dates.date_figures)."""
    texts: dict[str, str] = {}
    for name in names:
        folder = out / DATE / name
        result = read_outputs(folder / "output.jsonl")
        try:
            completed = json.loads((folder / "batch.json").read_text())["request_counts"]["completed"]
        except (OSError, ValueError, KeyError):
            completed = None
        if result["ok"] != lines[name] or completed != lines[name]:
            raise SystemExit(f"{system}: {name} answered {result['ok']} of {lines[name]} lines "
                             f"(batch.json completed {completed}); see {', '.join(logs)}")
        texts.update(result["texts"])
    fig = date_figures(out)
    if fig["files"] != len(names):
        raise SystemExit(f"{system}: {fig['files']} batch.json for {len(names)} files under {out / DATE}")
    return {**fig, "texts": texts}


def run_system(system: str, ctx: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """One timed run of a system into a fresh folder."""
    run_dir.mkdir(parents=True)
    out, inbox, python, timeout = run_dir / "out", ctx["inbox"], ctx["python"], ctx["timeout"]
    names, env = ctx["names"], ctx["env"]
    load_before = loadavg()
    if system in WARM_SYSTEMS:
        server: WarmServer = ctx["server"]
        env = server.fresh_env(env)  # its prefix cache reset, untimed: nothing of an earlier round or system is cached
    if system in DATE_SYSTEMS:
        started = time.perf_counter()
        m = run_date(python, ctx["date_child"], inbox, out, env, run_dir / "log.txt", timeout)
        wall, measured = time.perf_counter() - started, [m]
    elif system == "file_runs_inprocess":
        started, measured = time.perf_counter(), []
        for name in names:
            m = measure([python, str(ctx["file_child"]), str(inbox), str(out), f"{DATE}/{name}"], env,
                        run_dir / f"log-{name}.txt", timeout)
            measured.append(m)
            if m["exit_code"] != 0:
                break
        wall = time.perf_counter() - started
    else:  # file_runs_warm: env names the warm engine
        results: dict[str, dict[str, Any]] = {}

        def one(name: str) -> None:
            results[name] = measure([python, str(ctx["file_child"]), str(inbox), str(out), f"{DATE}/{name}"], env,
                                    run_dir / f"log-{name}.txt", timeout)

        threads = [threading.Thread(target=one, args=(name,)) for name in names]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        measured = [results.get(n, {"exit_code": None, "log": str(run_dir / f"log-{n}.txt")}) for n in names]
    logs = [m["log"] for m in measured]
    bad = [m for m in measured if m["exit_code"] != 0]
    if bad or len(measured) != (1 if system in DATE_SYSTEMS else len(names)):
        raise SystemExit(f"{system}: a run failed (exit codes {[m['exit_code'] for m in measured]}); see {', '.join(logs)}")
    return {"system": system, "wall_s": round(wall, 2), "runs_wall_s": [m["wall_s"] for m in measured],
            "loadavg_before": load_before, **check_outputs(system, out, names, ctx["lines"], logs)}


@dataclass
class _Setup:
    """The date written and what every run gets: the pipeline, its environment, the files, the context."""

    work: Path
    env: dict[str, str]  # every run's environment (the engine settings, ORDER=planned, the pipeline first)
    src: Path  # the folder holding the batch_pipeline package the runs import
    pre: dict[str, Any]  # the preflight: served model name and model path
    workload: dict[str, Any]  # write_date's figures
    names: list[str]  # the date's files, without .jsonl
    ctx: dict[str, Any]  # run_system's context


@dataclass
class _Timing:
    """The timed runs and the load average around them."""

    runs: list[dict[str, Any]]
    load_start: str
    load_end: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_date_options(p)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--server-scheduler", choices=("match", "default"), default="match",
                   help="match: the server gets the in-process LLM class's max_num_seqs / max_num_batched_tokens "
                        "(default); default: the server's own")
    p.add_argument("--pipeline-rev", default="HEAD", help="the pipeline the runs use, exported (default HEAD; worktree)")
    p.add_argument("--pipeline-src", type=Path, default=None, help="a folder holding batch_pipeline/ (wins over --pipeline-rev)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCH_PIPELINE_CACHE") or DEFAULT_CACHE))
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=1800, help="per run (default 1800 s)")
    p.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"), help="flock held while timing ('' for none)")
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    add_engine_options(p)
    return p.parse_args(argv)


def _prepare(args: argparse.Namespace, work: Path) -> _Setup:
    """The runs' environment and pipeline, the date's files written under work/in, the children's scripts."""
    env = child_env(args.cache, work / "tmp")
    for name in ("ENGINE_URL", "ENGINE_API_KEY", "MODELS_FILE", "ENGINE_ARGS", "BATCH_SIZE", "MAX_NUM_BATCHED_TOKENS",
                 "ENGINE_WINDOW", "MODEL_PATH", "SERVED_MODEL_NAME", "SHARDS"):
        env.pop(name, None)
    apply_engine_settings(args, env)
    env["ORDER"] = "planned"
    src = pipeline_source(args, work)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(src), env.get("PYTHONPATH", "")) if x)
    say(f"pipeline: {src}; engine settings: " + ", ".join(f"{k}={env.get(k, '(default)')}" for k in
                                                          ("MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES", "ENABLE_PREFIX_CACHING")))
    pre = preflight(args.python, env)
    workload = write_date(args, pre["served_model_name"], pre["model_path"], work / "in")
    names = sorted(f.stem for f in (work / "in" / DATE).glob("*.jsonl"))
    lines = {n: sum(1 for raw in (work / "in" / DATE / f"{n}.jsonl").read_text().splitlines() if raw.strip()) for n in names}
    say(f"{workload['lines']} lines ({args.num_docs} documents x {args.questions_per_doc} questions, shuffled) in "
        f"{len(names)} files of {work / 'in' / DATE}")
    (work / "date_child.py").write_text(DATE_RUN_CHILD)
    (work / "file_child.py").write_text(FILE_CHILD)
    ctx: dict[str, Any] = {"inbox": work / "in", "python": args.python, "timeout": args.timeout, "names": names,
                           "lines": lines, "env": env, "date_child": work / "date_child.py",
                           "file_child": work / "file_child.py", "server": None}
    return _Setup(work=work, env=env, src=src, pre=pre, workload=workload, names=names, ctx=ctx)


def _start_server(args: argparse.Namespace, setup: _Setup, lock: Path | None) -> WarmServer:
    """The warm engine of file_runs_warm, started (untimed) under the lock; its handle (set in the context too)."""
    server = start_like_runs(setup.env, setup.pre["model_path"], setup.pre["served_model_name"],
                             setup.work / "server.log",
                             LLM_CLASS_SCHEDULER if args.server_scheduler == "match" else None, lock)
    setup.ctx["server"] = server
    return server


def _measure(args: argparse.Namespace, setup: _Setup, systems: list[str]) -> _Timing:
    """The warm engine if wanted, then the rotating rounds under the lock; the engine stopped at the end."""
    lock = args.lock if str(args.lock) not in ("", ".") else None
    runs: list[dict[str, Any]] = []
    server: WarmServer | None = None
    load_start = loadavg()  # again when the timing starts
    previous_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server is stopped on SIGTERM
    try:
        if set(WARM_SYSTEMS) & set(systems):
            server = _start_server(args, setup, lock)
        with bench_lock(lock):
            load_start = loadavg()
            for round_no, system in rotating_rounds(systems, args.rounds):
                say(f"round {round_no}/{args.rounds}: {system} ... (load {loadavg()})")
                record = {"round": round_no, **run_system(system, setup.ctx, setup.work / f"r{round_no}-{system}")}
                runs.append(record)
                say(f"  {system}: {record['wall_s']:.1f} s wall (runs {record['runs_wall_s']}), inference "
                    f"{record['inference_s']:.1f} s, hit rate {record['hit_rate']:.1%}, {record['completed']} lines")
    finally:
        if server is not None:
            server.stop()
            say("warm engine stopped")
        signal.signal(signal.SIGTERM, previous_term)
        load_end = loadavg()
    return _Timing(runs=runs, load_start=load_start, load_end=load_end)


def _report(args: argparse.Namespace, setup: _Setup, timing: _Timing, systems: list[str]
            ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Print every run, the medians and the targets' ratios; (the medians, the ratios)."""
    runs = timing.runs
    # Greedy answers: how many lines each system answered word for word as the first system did.
    reference = runs[0]["texts"]
    for r in runs:
        r["same_texts"] = sum(1 for k, v in r.pop("texts").items() if reference.get(k) == v)
    summary = medians(runs, systems, ("wall_s", "inference_s", "model_load_s", "planning_s", "hit_rate"), digits=3)
    total = setup.workload["lines"]
    print(f"\n{total} lines ({args.num_docs} documents x {args.questions_per_doc} questions) in {len(setup.names)} files of one "
          f"date, {args.rounds} rotating rounds; pipeline {setup.src}; server scheduler {args.server_scheduler}; load average "
          f"{timing.load_start} when the timing started, {timing.load_end} at the end")
    print(f"{'round':<7}{'system':<21}{'wall s':>9}{'inference s':>13}{'model load s':>14}{'hit rate':>10}{'same answers':>14}")
    for r in runs:
        print(f"{r['round']:<7}{r['system']:<21}{r['wall_s']:>9.1f}{r['inference_s']:>13.1f}{r['model_load_s']:>14.1f}"
              f"{r['hit_rate']:>10.1%}{r['same_texts']:>9}/{total}")
    print("medians:")
    for system, s in summary.items():
        print(f"{'':<7}{system:<21}{s['wall_s']:>9.1f}{s['inference_s']:>13.1f}{s['model_load_s']:>14.1f}{s['hit_rate']:>10.1%}")
    ratios: dict[str, float] = {}
    w = summary.get("file_runs_warm", {}).get("wall_s")
    if w and "date_run" in summary:
        ratios["file_runs_warm/date_run"] = round(w / summary["date_run"]["wall_s"], 3)
        print(f"file_runs_warm / date_run: {ratios['file_runs_warm/date_run']:.2f}x (target: at most 1.10x) -> "
              f"{'met' if ratios['file_runs_warm/date_run'] <= 1.10 else 'NOT met'}")
    d = summary.get("date_run_warm", {}).get("wall_s")
    if d and "date_run" in summary:
        ratios["date_run_warm/date_run"] = round(d / summary["date_run"]["wall_s"], 3)
        print(f"date_run_warm / date_run: {ratios['date_run_warm/date_run']:.2f}x (the server path alone, one run)")
    if w and d:
        ratios["file_runs_warm/date_run_warm"] = round(w / d, 3)
        print(f"file_runs_warm / date_run_warm: {ratios['file_runs_warm/date_run_warm']:.2f}x (cutting the date into "
              "file runs, both on the warm engine)")
    if w and "file_runs_inprocess" in summary:
        ratios["file_runs_inprocess/file_runs_warm"] = round(summary["file_runs_inprocess"]["wall_s"] / w, 3)
        print(f"file_runs_inprocess / file_runs_warm: {ratios['file_runs_inprocess/file_runs_warm']:.2f}x (target: at least "
              f"1.40x) -> {'met' if ratios['file_runs_inprocess/file_runs_warm'] >= 1.40 else 'NOT met'}")
    return summary, ratios


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = chosen_systems(args.systems, SYSTEMS)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="bench-date-files-runs-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    say(f"work folder {work}; load average {loadavg()}")
    setup = _prepare(args, work)
    timing = _measure(args, setup, systems)
    summary, ratios = _report(args, setup, timing, systems)
    if args.json:
        env = setup.env
        args.json.write_text(json.dumps({"workload": setup.workload, "pipeline": str(setup.src),
                                         "server_scheduler": args.server_scheduler,
                                         "engine": {k: env.get(k) for k in ("MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES",
                                                                             "ENABLE_PREFIX_CACHING")},
                                         "load_start": timing.load_start, "load_end": timing.load_end, "runs": timing.runs,
                                         "summary": summary, "ratios": ratios}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A date of many small files backfilled as one Dagster run per file on a warm engine: what a run costs
beyond its answers (issue 38).

A script, not a test. From the repository root:

    nice -n 10 .venv/bin/python bench/file_backfill.py --json /tmp/file_backfill.json   # 100 files x 2 lines
    nice -n 10 .venv/bin/python bench/file_backfill.py --files 5                         # a smoke run, ~3 min
    .venv/bin/python bench/file_backfill.py --files 12 --rounds 4 --launchers forked,default  # the launchers side by side

Issue 38: "A date of 100 small files backfills as 100 runs on a warm engine; the cost of a run beyond its
answers (launch, Dagster, writing) is measured and stated, aiming at 5 s or less on this machine size."

What runs, all on 127.0.0.1, inside an exclusive flock on --lock (/tmp/bench.lock; other benchmarks take
the same lock, so this one waits for them):

1. One warm engine: vLLM's OpenAI-compatible server with the flags `batch-pipeline engine start` gives it
   (engine/server.py), on the bundled SmolLM2-135M-Instruct with the pipeline's default CPU engine
   settings, started once and stopped at the end: its start is printed apart, not timed.
2. Per round, --files (100) JSONL batch files `<input>/<date>/f-NNN.jsonl` of --lines (2) chat lines each
   (OpenAI Batch format, /v1/chat/completions, --max-tokens 8, temperature 0; each round its own texts),
   --date (default yesterday, UTC; PARTITIONS_START is set to it).
3. Per round, a fresh `dagster dev` (its own DAGSTER_HOME with the repo's dagster.yaml, as `make dev`
   does; web server, daemon, code server; with --launchers, the rounds take the run launchers in turn:
   `forked`, dagster.yaml's ForkedRunLauncher, or `default`, Dagster's DefaultRunLauncher in a copy of it) with ENGINE_URL at the warm engine, started untimed. The files'
   `batch_files` partitions (`<date>/f-NNN`) are added (instance.add_dynamic_partitions), then ONE
   backfill of job `batch_file_job` over those partition keys is launched through the web server's
   GraphQL `launchPartitionBackfill` (the job's partition set, partitionNames), as Jobs > batch_file_job >
   Partitions > Launch backfill does. Timed: from the launch to the end of the last run (Dagster's own end
   time; the poll that sees it is printed too). Every run must succeed and every file's batch.json must say
   completed with all its lines answered (and output.jsonl hold an answer for each), else the script stops.
4. Baseline, same round, same warm engine: the same files' lines sent straight to the server with one
   HTTP client (httpx), (a) `sequential`: the files one after another, each file's lines at once (what a
   run does, without the run), and (b) `concurrent`: all lines, at most --baseline-concurrency (4) in
   flight. The pipeline's wall time over each is the overhead ratio.

Printed: the backfill's wall time and runs per minute; per run (Dagster's run records and events) the
queue wait (creation to the daemon's launch, RUN_STARTING), the launch (RUN_STARTING to RUN_START: the run
worker's process start, imports, loading the code), the run's duration (RUN_START to its end), the
`batch_files` step, the answering wall time (metrics.json `inference_seconds` / `engine_token_share`: on a
warm engine `inference_seconds` is the answering time times the run's share of the tokens the engine
computed meanwhile, docs/ENGINE.md) and the cost beyond answers: launched-to-end minus answering wall
(the aim: <= 5 s, median), and run start-to-end minus answering wall; medians and p90 (nearest rank); the
most runs in progress at once; the backfill daemon's delay (launch to the first run's creation).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))
for _name in ("ENGINE_URL", "ENGINE_API_KEY", "MODELS_FILE", "ORDER", "MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES",
              "ENABLE_PREFIX_CACHING", "ENGINE_ARGS", "BATCH_SIZE", "MODEL_PATH", "SERVED_MODEL_NAME", "DAGSTER_HOME",
              "PARTITIONS_START", "STORAGE_INPUT_PATH", "STORAGE_OUTPUT_PATH"):
    os.environ.pop(_name, None)  # the pipeline's defaults for the runs and for the warm server alike
os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))

from common import bench_lock, instance_settings, loadavg, pct, say  # noqa: E402
from warm_server import WarmServer  # noqa: E402
from workloads import summary_bodies, write_batch  # noqa: E402

JOB = "batch_file_job"
STEP = "batch_files"
PARTITIONS = "batch_files"
AIM_S = 5.0
PARTITION_SETS = """query($r: RepositorySelector!, $job: String!) { partitionSetsOrError(repositorySelector: $r,
  pipelineName: $job) { __typename ... on PartitionSets { results { name pipelineName } } ... on PythonError { message } } }"""
LAUNCH = """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) { __typename
  ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }"""


def stats(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"median": round(statistics.median(values), 3), "p90": round(pct(values, 90), 3),
            "min": round(min(values), 3), "max": round(max(values), 3), "n": len(values)}


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start closes first)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    now = best = 0
    for _, d in events:
        now += d
        best = max(best, now)
    return best


def write_files(inbox: Path, date: str, round_no: int, args: argparse.Namespace, served: str) -> dict[str, list]:
    """{name: [(custom_id, body), ...]}; each written to <inbox>/<date>/<name>.jsonl."""
    folder = inbox / date
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for i in range(args.files):
        name = f"f-{i:03d}"
        bodies = summary_bodies(f"file-backfill-{round_no}-{i}", f"r{round_no}-f{i:03d}", args.lines, served, args.max_tokens)
        write_batch(folder / f"{name}.jsonl", bodies)
        files[name] = bodies
    return files


def check_file(out: Path, date: str, name: str, lines: int) -> dict[str, Any]:
    """The file's batch.json says completed with every line answered, output.jsonl has each answer; its metrics."""
    folder = out / date / name
    try:
        batch = json.loads((folder / "batch.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{date}/{name}: no readable batch.json in {folder} ({e})") from None
    counts = batch.get("request_counts") or {}
    if batch.get("status") != "completed" or counts.get("completed") != lines or counts.get("failed"):
        raise SystemExit(f"{date}/{name}: batch.json says {batch.get('status')}, counts {counts}; see {folder}")
    answered = 0
    for raw in (folder / "output.jsonl").read_text().splitlines():
        if raw.strip():
            response = json.loads(raw).get("response") or {}
            content = ((response.get("body") or {}).get("choices") or [{}])[0].get("message", {}).get("content")
            answered += response.get("status_code") == 200 and content is not None
    if answered != lines:
        raise SystemExit(f"{date}/{name}: {answered} of {lines} lines answered in {folder / 'output.jsonl'}")
    try:
        return json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def answer_wall_s(metrics: dict[str, Any]) -> float | None:
    """The run's answering wall time: metrics.json's inference_seconds is it times the run's token share of
    the warm engine (docs/ENGINE.md), so divided back; inference_seconds itself when no share is recorded."""
    infer = metrics.get("inference_seconds")
    if infer is None:
        return None
    share = metrics.get("engine_token_share")
    if share:
        return float(infer) / float(share)
    return float(infer)


class Round:
    """One fresh `dagster dev` over this round's files, with ENGINE_URL at the warm engine."""

    def __init__(self, root: Path, model_dir: Path, served: str, engine_url: str, date: str,
                 launcher: str = "forked") -> None:
        from batch_pipeline_tests.support.dagster_server import start_dagster_dev

        root.mkdir(parents=True)
        self.root = root
        self.inbox, self.out = root / "in", root / "out"
        self.inbox.mkdir()
        (root / "tmp").mkdir()
        self.env = {"STORAGE_INPUT_PATH": str(self.inbox), "STORAGE_OUTPUT_PATH": str(self.out),
                    "MODEL_PATH": str(model_dir), "SERVED_MODEL_NAME": served, "ENGINE_URL": engine_url,
                    "PARTITIONS_START": date, "TMPDIR": str(root / "tmp")}
        self.dagster = None
        self.launcher = launcher
        instance_yaml = instance_settings(root, launcher)
        self.start_dagster = lambda: start_dagster_dev(root / "home", self.env, root / "dagster-dev.log",
                                                         instance_yaml=instance_yaml)

    def start(self) -> None:
        started = time.perf_counter()
        self.dagster = self.start_dagster()
        self.start_s = round(time.perf_counter() - started, 2)
        self.instance = self.dagster.instance()

    def stop(self) -> None:
        if self.dagster is not None:
            self.dagster.stop()  # SIGKILL to its process group: web server, daemon, code server, run workers


def launch_backfill(rnd: Round, keys: list[str]) -> tuple[str, str]:
    from batch_pipeline_tests.support.dagster_server import LOCATION, REPOSITORY, GraphQLError

    repo = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
    sets = rnd.dagster.graphql(PARTITION_SETS, {"r": repo, "job": JOB})["partitionSetsOrError"]
    names = [s["name"] for s in sets.get("results", []) if s["pipelineName"] == JOB]
    if not names:
        raise GraphQLError(f"no partition set for {JOB}: {sets}")
    params = {"selector": {"partitionSetName": names[0], "repositorySelector": repo}, "partitionNames": keys,
              "title": f"bench file_backfill: {len(keys)} files"}
    result = rnd.dagster.graphql(LAUNCH, {"p": params}, timeout=120)["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        raise GraphQLError(f"launchPartitionBackfill: {result}")
    return result["backfillId"], names[0]


def wait_runs(rnd: Round, backfill_id: str, n: int, poll: float, timeout: float) -> tuple[list[Any], float]:
    """The backfill's run records once n of them have ended; the seconds the script's poll saw that."""
    import dagster as dg

    started = time.perf_counter()
    terminal = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}
    last_note = 0.0
    while True:
        records = rnd.instance.get_run_records(dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        ended = [r for r in records if r.dagster_run.status in terminal]
        failed = [r for r in ended if r.dagster_run.status != dg.DagsterRunStatus.SUCCESS]
        if failed:
            r = failed[0].dagster_run
            raise SystemExit(f"run {r.run_id} ({r.tags.get('dagster/partition')}) ended {r.status.value}; "
                             f"{len(failed)} run(s) not successful so far; see {rnd.root}")
        if len(ended) >= n:
            return records, round(time.perf_counter() - started, 2)
        backfill = rnd.instance.get_backfill(backfill_id)
        if backfill is not None and backfill.status.value in ("FAILED", "CANCELED", "COMPLETED_FAILED"):
            raise SystemExit(f"backfill {backfill_id} {backfill.status.value}: {backfill.error}")
        elapsed = time.perf_counter() - started
        if elapsed > timeout:
            raise SystemExit(f"{n - len(ended)} of {n} runs unfinished after {timeout:.0f} s; see {rnd.root}")
        if elapsed - last_note >= 30:
            last_note = elapsed
            say(f"  {elapsed:.0f} s: {len(records)} runs created, {len(ended)} ended (load {loadavg()})")
        time.sleep(poll)


def run_figures(rnd: Round, record: Any) -> dict[str, Any]:
    import dagster as dg

    run = record.dagster_run
    wanted = {dg.DagsterEventType.RUN_ENQUEUED, dg.DagsterEventType.RUN_DEQUEUED, dg.DagsterEventType.RUN_STARTING,
              dg.DagsterEventType.RUN_START, dg.DagsterEventType.RUN_SUCCESS}
    at: dict[str, float] = {}
    for event_type in wanted:
        result = rnd.instance.get_records_for_run(run.run_id, of_type=event_type, limit=1)
        if result.records:
            at[event_type.value] = result.records[0].event_log_entry.timestamp
    step = next((s for s in rnd.instance.get_run_step_stats(run.run_id) if s.step_key == STEP), None)
    created = record.create_timestamp.timestamp()
    launched = at.get("PIPELINE_STARTING") or at.get("RUN_STARTING")
    start, end = record.start_time, record.end_time
    date, name = run.tags["dagster/partition"].split("/", 1)
    metrics = check_file(rnd.out, date, name, rnd.lines)
    wall = answer_wall_s(metrics)
    figs = {
        "run_id": run.run_id, "partition": run.tags["dagster/partition"], "engine_tag": run.tags.get("batch_pipeline/engine"),
        "created": created, "launched": launched, "started": start, "ended": end,
        "queued_s": round(launched - created, 3) if launched else None,
        "launch_s": round(start - launched, 3) if launched and start else None,
        "duration_s": round(end - start, 3),
        "launched_to_end_s": round(end - launched, 3) if launched else None,
        "step_s": round(step.end_time - step.start_time, 3) if step and step.end_time else None,
        "before_step_s": round(step.start_time - start, 3) if step else None,
        "after_step_s": round(end - step.end_time, 3) if step and step.end_time else None,
        "inference_seconds": metrics.get("inference_seconds"), "engine_token_share": metrics.get("engine_token_share"),
        "engine_busy_share": metrics.get("engine_busy_share"), "answer_wall_s": round(wall, 3) if wall is not None else None,
        "validation_seconds": metrics.get("validation_seconds"), "writing_seconds": metrics.get("writing_seconds"),
        "model_load_seconds": metrics.get("model_load_seconds"), "engine_url": metrics.get("engine_url"),
    }
    if wall is not None:
        figs["beyond_answers_s"] = round(end - launched - wall, 3) if launched else None
        figs["run_beyond_answers_s"] = round(end - start - wall, 3)
    return figs


def baseline(url: str, files: dict[str, list], concurrency: int) -> dict[str, Any]:
    """The same lines straight to the warm engine with one httpx client: files one after another (each
    file's lines at once), then all lines at most `concurrency` in flight."""
    import httpx

    limits = httpx.Limits(max_connections=max(concurrency, max(len(b) for b in files.values())))
    with httpx.Client(base_url=url, timeout=300, limits=limits) as client:
        def ask(body: dict[str, Any]) -> str:
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            content = r.json()["choices"][0]["message"]["content"]
            if content is None:
                raise SystemExit("baseline: an answer without content")
            return content

        per_file = []
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(max(len(b) for b in files.values())) as pool:
            for bodies in files.values():
                t = time.perf_counter()
                list(pool.map(ask, [b for _, b in bodies]))
                per_file.append(time.perf_counter() - t)
        sequential_s = time.perf_counter() - t0
        every = [b for bodies in files.values() for _, b in bodies]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(ask, every))
        concurrent_s = time.perf_counter() - t0
    return {"sequential_s": round(sequential_s, 2), "per_file_s": stats(per_file),
            "concurrent_s": round(concurrent_s, 2), "concurrency": concurrency, "requests": len(every)}


def pipeline(rnd: Round, files: dict[str, list], date: str, args: argparse.Namespace) -> dict[str, Any]:
    keys = [f"{date}/{name}" for name in files]
    rnd.instance.add_dynamic_partitions(PARTITIONS, keys)
    load_before = loadavg()
    say(f"  launching one backfill of {JOB} over {len(keys)} partitions (load {load_before})")
    t_launch = time.time()
    p0 = time.perf_counter()
    backfill_id, partition_set = launch_backfill(rnd, keys)
    launch_call_s = round(time.perf_counter() - p0, 2)
    records, seen_s = wait_runs(rnd, backfill_id, len(keys), args.poll, args.timeout)
    load_after = loadavg()
    runs = sorted((run_figures(rnd, r) for r in records), key=lambda f: f["partition"])
    if len(runs) != len(keys) or sorted(f["partition"] for f in runs) != sorted(keys):
        raise SystemExit(f"backfill {backfill_id}: {len(runs)} runs for {len(keys)} partitions")
    last_end = max(f["ended"] for f in runs)
    wall = round(last_end - t_launch, 2)
    first_created = min(f["created"] for f in runs)
    first_started = min(f["started"] for f in runs)
    tags = {f["engine_tag"] for f in runs}
    return {
        "backfill_id": backfill_id, "partition_set": partition_set, "runs_n": len(runs), "launch_call_s": launch_call_s,
        "wall_s": wall, "poll_saw_all_s": round(seen_s + launch_call_s, 2), "runs_per_min": round(60 * len(runs) / wall, 2),
        "launch_to_first_run_created_s": round(first_created - t_launch, 2),
        "launch_to_last_run_created_s": round(max(f["created"] for f in runs) - t_launch, 2),
        "launch_to_first_run_start_s": round(first_started - t_launch, 2),
        "first_start_to_last_end_s": round(last_end - first_started, 2),
        "max_overlap_started": max_overlap([(f["started"], f["ended"]) for f in runs]),
        "max_overlap_launched": max_overlap([(f["launched"] or f["started"], f["ended"]) for f in runs]),
        "engine_tags": sorted(t or "(none)" for t in tags),
        "summary": {k: stats([f.get(k) for f in runs]) for k in (
            "queued_s", "launch_s", "duration_s", "launched_to_end_s", "step_s", "before_step_s", "after_step_s",
            "inference_seconds", "answer_wall_s", "engine_busy_share", "engine_token_share", "validation_seconds",
            "writing_seconds", "beyond_answers_s", "run_beyond_answers_s")},
        "answer_wall_sum_s": round(sum(f["answer_wall_s"] or 0 for f in runs), 2),
        "load_before": load_before, "load_after": load_after, "runs": runs,
    }


def show(k: str, s: dict[str, float], label: str) -> None:
    if s:
        print(f"  {label:<58}{s['median']:>9.2f}{s['p90']:>9.2f}{s['min']:>9.2f}{s['max']:>9.2f}")
    else:
        print(f"  {label:<58}{'n/a':>9}")


def report(args: argparse.Namespace, engine: WarmServer, rounds: list[dict[str, Any]], load_start: str, load_end: str,
           date: str) -> dict[str, Any]:
    print(f"\nFile backfill on a warm engine: {args.files} files x {args.lines} chat lines (max_tokens {args.max_tokens}) "
          f"of {date}, one backfill of {JOB}, {len(rounds)} round(s); cpu count {os.cpu_count()}; "
          f"load {load_start} -> {load_end}")
    print(f"warm engine start (untimed): {engine.start_s:.1f} s to healthy, first request {engine.first_request_s:.2f} s; "
          f"dagster dev start (untimed): {', '.join(str(r['dagster_start_s']) for r in rounds)} s")
    verdicts = []
    for r in rounds:
        p, b = r["pipeline"], r["baseline"]
        print(f"\nround {r['round']}, {r['launcher']} run launcher (load {p['load_before']} -> {p['load_after']}; backfill {p['backfill_id']}, "
              f"partition set {p['partition_set']}, run tags batch_pipeline/engine: {', '.join(p['engine_tags'])})")
        print(f"  backfill wall time (launch to the last run's end): {p['wall_s']:.1f} s for {p['runs_n']} runs, all "
              f"SUCCESS: {p['runs_per_min']:.1f} runs/min ({p['wall_s'] / p['runs_n']:.2f} s a run); the poll saw it "
              f"at {p['poll_saw_all_s']:.1f} s")
        print(f"  launch to the first run created {p['launch_to_first_run_created_s']:.1f} s (the backfill daemon), "
              f"to the last created {p['launch_to_last_run_created_s']:.1f} s, to the first run started "
              f"{p['launch_to_first_run_start_s']:.1f} s; first start to last end {p['first_start_to_last_end_s']:.1f} s")
        print(f"  most runs in progress at once: {p['max_overlap_started']} (start to end), "
              f"{p['max_overlap_launched']} (launched to end)")
        print(f"  {'per run, seconds':<58}{'median':>9}{'p90':>9}{'min':>9}{'max':>9}")
        s = p["summary"]
        for k, label in (("queued_s", "queued: created -> launched (RUN_STARTING)"),
                         ("launch_s", "launch: launched -> RUN_START (run worker start-up)"),
                         ("duration_s", "run: RUN_START -> end"),
                         ("launched_to_end_s", "launched -> end"),
                         ("step_s", f"the {STEP} step"),
                         ("before_step_s", "RUN_START -> step start"),
                         ("after_step_s", "step end -> run end"),
                         ("validation_seconds", "validation (metrics.json)"),
                         ("writing_seconds", "writing (metrics.json)"),
                         ("inference_seconds", "inference_seconds (metrics.json: x token share)"),
                         ("engine_token_share", "engine_token_share"),
                         ("engine_busy_share", "engine_busy_share"),
                         ("answer_wall_s", "answering wall (inference_seconds / token share)"),
                         ("run_beyond_answers_s", "beyond answers: RUN_START -> end minus answering"),
                         ("beyond_answers_s", "BEYOND ANSWERS: launched -> end minus answering")):
            show(k, s.get(k, {}), label)
        beyond = s.get("beyond_answers_s", {}).get("median")
        met = beyond is not None and beyond <= AIM_S
        verdicts.append(met)
        print(f"  baseline, the same {b['requests']} requests straight to the warm engine (one httpx client): files one "
              f"after another {b['sequential_s']:.1f} s (a file {b['per_file_s']['median']:.2f} s median, "
              f"{b['per_file_s']['p90']:.2f} p90), all at {b['concurrency']} in flight {b['concurrent_s']:.1f} s")
        print(f"  backfill / baseline: {p['wall_s'] / b['sequential_s']:.1f}x the sequential, "
              f"{p['wall_s'] / b['concurrent_s']:.1f}x the concurrent; warm engine CPU in the backfill "
              f"{r['engine_cpu_backfill_s']:.1f} s, in the baseline {r['engine_cpu_baseline_s']:.1f} s")
        print(f"  issue 38's aim, a run's cost beyond its answers (launched -> end minus answering wall, median) <= "
              f"{AIM_S:.0f} s: {beyond} s -> {'MET' if met else 'NOT MET'}")
    by_launcher = {}
    for name in dict.fromkeys(r["launcher"] for r in rounds):
        mine = [r["pipeline"] for r in rounds if r["launcher"] == name]
        by_launcher[name] = {
            "rounds": len(mine), "wall_s": [p["wall_s"] for p in mine],
            "launch_s_median": [p["summary"].get("launch_s", {}).get("median") for p in mine],
            "beyond_answers_s_median": [p["summary"].get("beyond_answers_s", {}).get("median") for p in mine]}
        print(f"\n{name} run launcher, {len(mine)} round(s): backfill wall {by_launcher[name]['wall_s']} s; run worker "
              f"start (median) {by_launcher[name]['launch_s_median']} s; beyond answers (median) "
              f"{by_launcher[name]['beyond_answers_s_median']} s")
    return {"aim_s": AIM_S, "aim_met_per_round": verdicts, "by_launcher": by_launcher}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=100, help="batch files of the date, one run each (default 100)")
    p.add_argument("--lines", type=int, default=2, help="chat lines per file (default 2)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1, help="rounds, each a fresh dagster dev and its own texts (default 1)")
    p.add_argument("--launchers", type=lambda v: v.split(","), default=["forked"],
                   help="run launchers the rounds take in turn: forked (dagster.yaml's ForkedRunLauncher), default "
                        "(Dagster's DefaultRunLauncher); e.g. forked,default with --rounds 4 (default forked)")
    p.add_argument("--date", default=None, help="the files' date, YYYY-MM-DD (default yesterday, UTC)")
    p.add_argument("--baseline-concurrency", type=int, default=4)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the runs")
    p.add_argument("--timeout", type=float, default=3600, help="per backfill, seconds")
    p.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"), help="flock held through the whole bench")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args()
    date = args.date or (dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)).isoformat()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop what was started
    from batch_pipeline.config import models

    model_dir = models.prepare_bundled_model(log=say)
    served = model_dir.name
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-file-backfill-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"work folder {work}")
    with bench_lock(args.lock):
        load_start = loadavg()
        engine = WarmServer.engine_start(model_dir, served, work / "warm-engine.log")
        rounds: list[dict[str, Any]] = []
        try:
            engine.start()
            for r in range(1, args.rounds + 1):
                launcher = args.launchers[(r - 1) % len(args.launchers)]
                rnd = Round(work / f"r{r}", model_dir, served, engine.url, date, launcher)
                rnd.lines = args.lines
                files = write_files(rnd.inbox, date, r, args, served)
                say(f"round {r}/{args.rounds} ({launcher} run launcher): {len(files)} files x {args.lines} lines written; "
                    "starting dagster dev (untimed)")
                try:
                    rnd.start()
                    say(f"  dagster dev ready after {rnd.start_s:.1f} s at {rnd.dagster.url}")
                    order = ["pipeline", "baseline"] if r % 2 else ["baseline", "pipeline"]
                    fig: dict[str, Any] = {"round": r, "launcher": launcher, "date": date, "dagster_start_s": rnd.start_s}
                    for part in order:
                        cpu = engine.cpu_s()
                        if part == "pipeline":
                            fig["pipeline"] = pipeline(rnd, files, date, args)
                            fig["engine_cpu_backfill_s"] = round(engine.cpu_s() - cpu, 1)
                            say(f"  backfill: {fig['pipeline']['runs_n']} runs in {fig['pipeline']['wall_s']:.1f} s")
                        else:
                            say(f"  baseline: {len(files)} files straight to the warm engine (load {loadavg()})")
                            fig["baseline"] = baseline(engine.url, files, args.baseline_concurrency)
                            fig["engine_cpu_baseline_s"] = round(engine.cpu_s() - cpu, 1)
                            say(f"  baseline: sequential {fig['baseline']['sequential_s']:.1f} s, "
                                f"concurrent {fig['baseline']['concurrent_s']:.1f} s")
                    rounds.append(fig)
                finally:
                    rnd.stop()
                    say("  dagster dev stopped")
        finally:
            engine.stop()
            say("warm engine stopped")
        load_end = loadavg()
    summary = report(args, engine, rounds, load_start, load_end, date)
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "date": date,
            "model": str(model_dir), "cpu_count": os.cpu_count(), "work_dir": str(work),
            "warm_engine": {"start_to_healthy_s": engine.start_s, "first_request_s": engine.first_request_s,
                            "command": engine.command},
            "loadavg_start": load_start, "loadavg_end": load_end, "rounds": rounds, "summary": summary}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A burst of small batches through the Batch API, each run loading its own engine against runs on one
warm vLLM server; and an urgent batch created while a bulk batch runs on that warm server.

A script, not a test. From the repository root:

    nice -n 10 .venv/bin/python bench/api_burst.py --json /tmp/api_burst.json     # 12 x 8, one round
    nice -n 10 .venv/bin/python bench/api_burst.py --batches 3 --lines 3 --bulk-lines 64   # a smoke run
    .venv/bin/python bench/api_burst.py --batches 1 --rounds 2 --poll 0.25 --launcher default  # Dagster's launcher
    .venv/bin/python bench/api_burst.py --priority-only --rounds 2 --poll 0.25  # the urgent batch only, its phases
    .venv/bin/python bench/api_burst.py --priority-only --rounds 3 --poll 0.25 --postgres  # on PostgreSQL storage
    .venv/bin/python bench/api_burst.py --priority-only --rounds 3 --poll 0.25 --engine-cores 1  # the engine computing on a core of its own

Issue 37 ("a warm engine per model"), through the Batch API. What runs, all on 127.0.0.1: per system
and round, a fresh `dagster dev` (the repo's dagster.yaml: SQLite, the queued run coordinator with
max_concurrent_runs 4 and at most 2 runs per tenant, the `gpu` pool at 1) and one `batch-pipeline serve`
over it, started before the timing and stopped after; the bundled SmolLM2-135M-Instruct with the
pipeline's default CPU engine settings. Two systems, their order rotating per round:

    in_process  no ENGINE_URL: each run worker imports vLLM and loads the model in its inference step;
    warm        ENGINE_URL at one vLLM OpenAI-compatible server (engine/server.py's command, the flags
                `batch-pipeline engine start` uses), started once before the rounds and stopped at the
                end: its start (launch to /health, then a first request) is printed apart, not timed.

1. Burst. --batches (12) files of --lines (8) chat lines ("Summarise in one sentence: ...", --max-tokens
   16, temperature 0; each round its own texts, the same for both systems) are uploaded (not timed),
   then all created at once from a thread pool with the unmodified openai SDK, spread over --tenants (4)
   tenants so the instance's run limit, not the per-tenant cap, bounds how many run at once. Timed: from
   the first create to the first poll (every --poll s, batches.retrieve) that sees the LAST one
   completed. Issue 37's target: warm at least 3x sooner than in_process.
2. Priority (warm only). A bulk batch of --bulk-lines (256) lines (--bulk-max-tokens 32) is created
   (tenant `bulk`); --urgent-after (2) s after its inference step started (Dagster's step stats), an urgent
   batch of --lines lines with metadata {"priority": "10"} (tenant `urgent`; the service's cap raised to 10)
   is created. Timed:
   the urgent batch's create to completed beside the bulk one, then (bulk finished) the same urgent
   file alone on the same engine; the bulk's create to completed too. Target: beside the bulk within
   1.5x of alone. The urgent batch alone runs second, so any prefix-cache reuse favours "alone".

By default the engine and everything else share every core. --engine-cores N binds the warm engine's
compute threads (VLLM_CPU_OMP_THREADS_BIND) to the last N usable cores and runs everything else on the
others: the server's API process and scheduler, this script, dagster dev, serve, the run workers (and
the burst's in-process engines). That is the CPU equivalent of a GPU host, where the model computes on
its own device while the CPUs run the server's front end and the runs' control steps.

Every batch must end `completed` with every line answered (status 200 and a message in its output file),
else the script stops. Also printed: the Dagster runs' own timings (queued: creation to start; the
`inference_results` step, and the sum of those steps: a run that builds its own engine holds the `gpu` pool
slot through it, one whose models are all on warm engines none, since bb29e51), model load and answering
seconds from each metrics.json (`inference_seconds`: on a warm engine the answering time times the run's
token share of the engine, not wall time), and whether the urgent run's inference step waited for the bulk's.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))
for _name in ("ENGINE_URL", "ENGINE_API_KEY", "MODELS_FILE", "ORDER", "MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES",
              "ENABLE_PREFIX_CACHING", "ENGINE_ARGS", "BATCH_SIZE", "MODEL_PATH", "SERVED_MODEL_NAME", "DAGSTER_HOME"):
    os.environ.pop(_name, None)  # the pipeline's defaults for the runs and for the warm server alike
os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))

from common import instance_settings, loadavg, say  # noqa: E402
from warm_server import WarmServer, add_engine_cores, apart_engine_env, engine_cores_error  # noqa: E402
from workloads import batch_text, summary_bodies  # noqa: E402

SYSTEMS = ("in_process", "warm")
URGENT_PRIORITY = "10"
TERMINAL = ("completed", "failed", "cancelled", "expired")
RUN_QUERY = """query($f: RunsFilter) { runsOrError(filter: $f) { ... on Runs { results { runId status creationTime
  startTime endTime stepStats { stepKey startTime endTime } } } } }"""


def key(tenant: str) -> str:
    return f"{tenant}-key-0123456789"


def lines_of(tag: str, n: int, served: str, max_tokens: int) -> bytes:
    """A batch file of `n` short chat lines, custom_ids `<tag>-<j>`."""
    return batch_text(summary_bodies(f"api-burst-{tag}", tag, n, served, max_tokens)).encode()


class Stack:
    """A `dagster dev` (the repo's dagster.yaml) and `batch-pipeline serve` over it; runs warm with engine_url."""

    def __init__(self, root: Path, model_dir: Path, engine_url: str | None, tenants: list[str],
                 launcher: str = "forked", postgres: bool = False) -> None:
        import contextlib

        import openai

        from batch_pipeline_tests.support.postgres_db import fresh_database

        from batch_pipeline_tests.support.dagster_server import free_port, start_dagster_dev, wait_for

        root.mkdir(parents=True)
        self.out = root / "out"
        env = {"STORAGE_INPUT_PATH": str(root / "in"), "STORAGE_OUTPUT_PATH": str(self.out),
               "MODEL_PATH": str(model_dir), "ENGINE_URL": engine_url, "TMPDIR": str(root / "tmp")}
        (root / "in").mkdir()
        (root / "tmp").mkdir()
        self.closing = contextlib.ExitStack()  # the database (--postgres), dropped by stop()
        database = self.closing.enter_context(fresh_database("api_burst")) if postgres else None
        try:
            self.dagster = start_dagster_dev(root / "home", env, root / "dagster-dev.log",
                                             instance_yaml=instance_settings(root, launcher, database))
        except BaseException:
            self.closing.close()
            raise
        port = free_port()
        serve_env = {**os.environ, **env, "DAGSTER_HOME": str(root / "home"), "DAGSTER_WEBSERVER_URL": self.dagster.url,
                     "BATCH_API_KEYS": ",".join(f"{t}:{key(t)}" for t in tenants), "BATCH_API_MAX_PRIORITY": URGENT_PRIORITY}
        for name in ("BATCH_API_KEYS_FILE", "BATCH_API_MAX_IN_FLIGHT", "BATCH_API_TENANT_LIMITS",
                     "BATCH_API_TENANT_MAX_PRIORITY", "BATCH_API_AUDIT_LOG"):
            serve_env.pop(name, None)
        with open(root / "serve.log", "wb") as log:
            self.serve = subprocess.Popen([str(Path(sys.executable).with_name("batch-pipeline")), "serve", "--port", str(port)],
                                          cwd=REPO, env={k: v for k, v in serve_env.items() if v is not None}, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if self.serve.poll() is not None:
                raise SystemExit(f"batch-pipeline serve exited ({self.serve.returncode}); see {root / 'serve.log'}")
            try:
                with urllib.request.urlopen(f"{self.base}/ready", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for("batch-pipeline serve ready", ready, 180, interval=0.5)
        self.sdk = {t: openai.OpenAI(base_url=f"{self.base}/v1", api_key=key(t), max_retries=0, timeout=300) for t in tenants}

    def run_timings(self, batch_id: str) -> dict[str, Any]:
        """The Dagster run of a batch: queued (creation to start), and its inference_results step (epoch seconds)."""
        runs = self.dagster.graphql(RUN_QUERY, {"f": {"tags": [{"key": "batch_pipeline/api_batch_id", "value": batch_id}]}})
        run = runs["runsOrError"]["results"][0]
        step = next((s for s in run["stepStats"] if s["stepKey"] == "inference_results"), {})
        return {"run_id": run["runId"], "created": run["creationTime"], "started": run["startTime"], "ended": run["endTime"],
                "queued_s": round((run["startTime"] or run["creationTime"]) - run["creationTime"], 2),
                "infer_start": step.get("startTime"), "infer_end": step.get("endTime"),
                "infer_step_s": round(step["endTime"] - step["startTime"], 2) if step.get("endTime") else None}

    def metrics(self, batch_id: str) -> dict[str, Any]:
        return next((json.loads(f.read_text()) for f in self.out.glob(f"*/{batch_id}/metrics.json")), {})

    def stop(self) -> None:
        if self.serve.poll() is None:
            self.serve.terminate()
            try:
                self.serve.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.serve.pid, signal.SIGKILL)
                self.serve.wait(10)
        self.dagster.stop()  # SIGKILL to its process group: web server, daemon, code server, run workers
        self.closing.close()


def create(stack: Stack, tenant: str, file_id: str, metadata: dict[str, str] | None = None) -> str:
    batch = stack.sdk[tenant].batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                             completion_window="24h", metadata=metadata)
    return batch.id


def wait_done(stack: Stack, pending: dict[str, tuple[str, float]], poll: float, timeout: float) -> dict[str, float]:
    """{batch id: seconds from its t0 to the first poll that saw it end}; pending maps batch id to (tenant, t0)."""
    done: dict[str, float] = {}
    start = time.perf_counter()
    while len(done) < len(pending):
        for bid, (tenant, t0) in pending.items():
            if bid not in done and stack.sdk[tenant].batches.retrieve(bid).status in TERMINAL:
                done[bid] = round(time.perf_counter() - t0, 2)
        if time.perf_counter() - start > timeout:
            raise SystemExit(f"{len(pending) - len(done)} batches unfinished after {timeout:.0f} s; see {stack.out.parent}")
        time.sleep(poll)
    return done


def check(stack: Stack, bid: str, tenant: str, lines: int) -> dict[str, str]:
    """The batch completed with every line answered; its answers {custom_id: text}."""
    sdk = stack.sdk[tenant]
    batch = sdk.batches.retrieve(bid)
    counts = batch.request_counts
    if batch.status != "completed" or counts is None or counts.completed != lines or counts.failed:
        raise SystemExit(f"batch {bid} ({tenant}): {batch.status}, counts {counts}, errors {batch.errors}; "
                         f"see {stack.out.parent}")
    texts = {}
    for raw in sdk.files.content(batch.output_file_id).text.splitlines():
        if raw.strip():
            line = json.loads(raw)
            response = line.get("response") or {}
            content = ((response.get("body") or {}).get("choices") or [{}])[0].get("message", {}).get("content")
            if response.get("status_code") == 200 and content is not None:
                texts[line["custom_id"]] = content
    if len(texts) != lines:
        raise SystemExit(f"batch {bid} ({tenant}): {len(texts)} of {lines} lines answered in its output file")
    return texts


def burst(stack: Stack, files: list[bytes], tenants: list[str], args: argparse.Namespace) -> dict[str, Any]:
    owners = [tenants[i % len(tenants)] for i in range(len(files))]
    file_ids = [stack.sdk[t].files.create(file=(f"burst-{i}.jsonl", data), purpose="batch").id
                for i, (t, data) in enumerate(zip(owners, files))]
    load_before = loadavg()
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(files)) as pool:
        ids = list(pool.map(lambda i: create(stack, owners[i], file_ids[i]), range(len(files))))
    created_s = round(time.perf_counter() - t0, 2)
    done = wait_done(stack, {bid: (t, t0) for bid, t in zip(ids, owners)}, args.poll, args.timeout)
    texts: dict[str, str] = {}
    batches = []
    for bid, tenant in zip(ids, owners):
        texts.update(check(stack, bid, tenant, args.lines))
        m = stack.metrics(bid)
        batches.append({"id": bid, "tenant": tenant, "done_s": done[bid], **stack.run_timings(bid),
                        "model_load_s": m.get("model_load_seconds"), "answering_s": m.get("inference_seconds")})
    first_infer = min(b["infer_start"] for b in batches)
    last_infer = max(b["infer_end"] for b in batches)
    steps = [b["infer_step_s"] for b in batches]
    return {"last_done_s": max(done.values()), "first_done_s": min(done.values()), "all_created_s": created_s,
            "batch_done_s_median": round(statistics.median(done.values()), 2),
            "queued_s_median": round(statistics.median(b["queued_s"] for b in batches), 2),
            "infer_step_s_median": round(statistics.median(steps), 2), "infer_step_s_sum": round(sum(steps), 2),
            # t0 is this process's clock; the runs' are epoch seconds: from the first run's creation instead
            "before_first_infer_s": round(first_infer - min(b["created"] for b in batches), 2),
            "infer_span_s": round(last_infer - first_infer, 2),
            "model_load_s_median": statistics.median(b["model_load_s"] or 0.0 for b in batches),
            "answering_s_median": statistics.median(b["answering_s"] or 0.0 for b in batches),
            "load_before": load_before, "load_after": loadavg(), "batches": batches, "texts": texts}


def priority(stack: Stack, bulk_file: bytes, urgent_file: bytes, args: argparse.Namespace) -> dict[str, Any]:
    bulk_fid = stack.sdk["bulk"].files.create(file=("bulk.jsonl", bulk_file), purpose="batch").id
    urgent_fid = stack.sdk["urgent"].files.create(file=("urgent.jsonl", urgent_file), purpose="batch").id
    load_before = loadavg()
    t_bulk = time.perf_counter()
    bulk = create(stack, "bulk", bulk_fid)
    while True:  # in progress, its inference step (sending requests to the engine) begun
        b = stack.sdk["bulk"].batches.retrieve(bulk)
        if b.status in TERMINAL:
            raise SystemExit(f"the bulk batch ended ({b.status}) before the urgent one was created: raise --bulk-lines")
        if b.status == "in_progress" and stack.run_timings(bulk)["infer_start"]:
            break
        if time.perf_counter() - t_bulk > args.timeout:
            raise SystemExit(f"the bulk batch {bulk}'s inference never started; see {stack.out.parent}")
        time.sleep(0.5)
    time.sleep(args.urgent_after)
    counts = stack.sdk["bulk"].batches.retrieve(bulk).request_counts
    bulk_answered_at_urgent = counts.completed if counts else 0  # as checkpointed (every 5 s)
    t_urgent, e_urgent = time.perf_counter(), time.time()
    urgent = create(stack, "urgent", urgent_fid, {"priority": URGENT_PRIORITY})
    done = wait_done(stack, {urgent: ("urgent", t_urgent), bulk: ("bulk", t_bulk)}, args.poll, args.timeout)
    urgent_s, bulk_s = done[urgent], done[bulk]
    check(stack, bulk, "bulk", args.bulk_lines)
    check(stack, urgent, "urgent", args.lines)
    bulk_run, urgent_run = ended_timings(stack, bulk), ended_timings(stack, urgent)
    load_mid = loadavg()
    t_alone, e_alone = time.perf_counter(), time.time()
    alone = create(stack, "urgent", urgent_fid, {"priority": URGENT_PRIORITY})
    alone_s = wait_done(stack, {alone: ("urgent", t_alone)}, args.poll, args.timeout)[alone]
    check(stack, alone, "urgent", args.lines)
    alone_run = ended_timings(stack, alone)
    gap = round(urgent_run["infer_start"] - bulk_run["infer_end"], 2)
    return {"urgent_beside_bulk_s": urgent_s, "urgent_alone_s": alone_s, "ratio": round(urgent_s / alone_s, 2),
            "bulk_s": bulk_s, "bulk_answered_when_urgent_created": bulk_answered_at_urgent,
            # its run had started before the bulk's inference step ended, and its own step began only after
            "urgent_infer_waited_for_bulk": urgent_run["started"] < bulk_run["infer_end"] <= urgent_run["infer_start"],
            "urgent_run_start_after_bulk_infer_end_s": round(urgent_run["started"] - bulk_run["infer_end"], 2),
            "urgent_infer_start_after_bulk_infer_end_s": gap,
            "urgent_infer_step_s": urgent_run["infer_step_s"], "alone_infer_step_s": alone_run["infer_step_s"],
            "bulk_infer_step_s": bulk_run["infer_step_s"], "urgent_metrics": stack.metrics(urgent),
            "runs": {"bulk": bulk_run, "urgent": urgent_run, "alone": alone_run},
            "phases": {"urgent": phases(e_urgent, urgent_run, urgent_s), "alone": phases(e_alone, alone_run, alone_s)},
            "load_before": load_before, "load_mid": load_mid, "load_after": loadavg()}


def ended_timings(stack: Stack, batch_id: str, timeout: float = 30.0) -> dict[str, Any]:
    """run_timings once the run has ended (a batch reads completed a moment before its run's end is stored)."""
    deadline = time.perf_counter() + timeout
    while (timings := stack.run_timings(batch_id))["ended"] is None and time.perf_counter() < deadline:
        time.sleep(0.2)
    return timings


def phases(created: float, run: dict[str, Any], done_s: float) -> dict[str, float]:
    """Where a batch's seconds went, from its create call (epoch `created`) to the poll that saw it done
    (`done_s` after it): to its run's creation (the service), the queue, the run's steps before its
    inference step, that step, the steps after it, and from the run's end to the poll."""
    marks = [created, run["created"], run["started"], run["infer_start"], run["infer_end"], run["ended"], created + done_s]
    names = ("service", "queued", "before_infer", "infer", "after_infer", "to_seen")
    return {name: round(b - a, 2) for name, a, b in zip(names, marks, marks[1:])}


def med(values: list[float]) -> float:
    return round(statistics.median(values), 2)


@dataclass
class _Setup:
    """What every round shares: the bundled model, the work folder, the burst's tenants, the warm engine."""

    model_dir: Path
    served: str
    work: Path
    tenants: list[str]
    server: WarmServer  # started once before the rounds, stopped at the end
    load_start: str


@dataclass
class _Figures:
    """Every round's figures: the burst per system, the priority runs (warm only)."""

    results: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    prio: list[dict[str, Any]] = field(default_factory=list)
    load_end: str = ""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batches", type=int, default=12, help="batches in the burst (default 12)")
    p.add_argument("--lines", type=int, default=8, help="chat lines per burst batch and in the urgent batch (default 8)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tenants", type=int, default=4, help="the burst's batches dealt over this many tenants (default 4)")
    p.add_argument("--bulk-lines", type=int, default=256)
    p.add_argument("--bulk-max-tokens", type=int, default=32)
    p.add_argument("--urgent-after", type=float, default=2.0,
                   help="seconds after the bulk's inference step starts to create the urgent batch (default 2)")
    p.add_argument("--no-priority", action="store_true", help="the burst only")
    p.add_argument("--priority-only", action="store_true", help="the priority part only (no in-process system, no burst)")
    p.add_argument("--postgres", action="store_true",
                   help="the instance's storage on PostgreSQL (a fresh database per stack, TEST_POSTGRES_* or "
                        "127.0.0.1:5432), as deploy/dagster.yaml has it, instead of dagster.yaml's SQLite")
    p.add_argument("--launcher", choices=("forked", "default"), default="forked",
                   help="the instance's run launcher: dagster.yaml's ForkedRunLauncher (default), or Dagster's "
                        "DefaultRunLauncher in a copy of it")
    add_engine_cores(p)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between polls of the unfinished batches")
    p.add_argument("--timeout", type=float, default=1800, help="per burst or batch, seconds")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args()
    placement = engine_cores_error(args.engine_cores)
    if placement:
        p.error(placement)
    if args.priority_only and args.no_priority:
        p.error("--priority-only and --no-priority leave nothing to measure")
    return args


def _prepare(args: argparse.Namespace) -> _Setup:
    """The bundled model, the work folder, the tenants; the warm engine started (untimed)."""
    from batch_pipeline.config import models

    model_dir = models.prepare_bundled_model(log=say)
    served = model_dir.name
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-api-burst-"))
    work.mkdir(parents=True, exist_ok=True)
    tenants = [f"tenant{i}" for i in range(args.tenants)]
    load_start = loadavg()
    say(f"work folder {work}; load average {load_start}")
    env = apart_engine_env(args.engine_cores)
    server = WarmServer.engine_start(model_dir, served, work / "warm-engine.log", env=env).start()
    return _Setup(model_dir=model_dir, served=served, work=work, tenants=tenants, server=server, load_start=load_start)


def _run_system(args: argparse.Namespace, setup: _Setup, figures: _Figures, r: int, system: str,
                files: list[bytes]) -> None:
    """One system in round `r`: its own dagster dev and serve, the burst, then (warm) the priority runs."""
    server = setup.server
    say(f"round {r}/{args.rounds}: {system}: starting dagster dev and batch-pipeline serve (untimed)")
    stack = Stack(setup.work / f"r{r}-{system}", setup.model_dir, server.url if system == "warm" else None,
                  setup.tenants + ["bulk", "urgent"], args.launcher, args.postgres)
    try:
        if args.priority_only:
            _priority_round(args, setup, figures, r, stack)
            return
        cpu = server.cpu_s()
        say(f"  burst: {args.batches} x {args.lines} lines over {args.tenants} tenants (load {loadavg()})")
        fig = burst(stack, files, setup.tenants, args)
        fig["server_cpu_s"] = round(server.cpu_s() - cpu, 1)
        figures.results[system].append({"round": r, **fig})
        say(f"  {system}: last of {args.batches} completed after {fig['last_done_s']:.1f} s (load {loadavg()})")
        if system == "warm" and not args.no_priority:
            _priority_round(args, setup, figures, r, stack)
    finally:
        stack.stop()


def _priority_round(args: argparse.Namespace, setup: _Setup, figures: _Figures, r: int, stack: Stack) -> None:
    say(f"  priority: bulk {args.bulk_lines} x {args.bulk_max_tokens}, then urgent {args.lines} lines")
    bulk_file = lines_of(f"r{r}-bulk", args.bulk_lines, setup.served, args.bulk_max_tokens)
    pr = priority(stack, bulk_file, lines_of(f"r{r}-urgent", args.lines, setup.served, args.max_tokens), args)
    figures.prio.append({"round": r, **pr})
    say(f"  urgent beside bulk {pr['urgent_beside_bulk_s']:.1f} s, alone {pr['urgent_alone_s']:.1f} s, "
        f"bulk {pr['bulk_s']:.1f} s")


def _measure(args: argparse.Namespace, setup: _Setup) -> _Figures:
    """--rounds rounds of both systems, their order rotating; the warm engine stopped at the end."""
    figures = _Figures()
    order = ["warm"] if args.priority_only else list(SYSTEMS)
    try:
        for r in range(1, args.rounds + 1):
            files = [lines_of(f"r{r}-b{b:02d}", args.lines, setup.served, args.max_tokens) for b in range(args.batches)]
            for system in order:
                _run_system(args, setup, figures, r, system, files)
            order = order[1:] + order[:1]
    finally:
        setup.server.stop()
        say("warm engine stopped")
    figures.load_end = loadavg()
    return figures


def _answers_equal(results: dict[str, list[dict[str, Any]]]) -> list[int]:
    """Per round: the lines the warm engine answered as the in-process one did."""
    return [sum(w["texts"].get(c) == t for c, t in i["texts"].items()) for i, w in zip(results["in_process"], results["warm"])]


def _print_burst(args: argparse.Namespace, setup: _Setup, figures: _Figures, equal: list[int]) -> dict[str, Any]:
    """The burst's table, per system and round; the summary of its target."""
    results, server = figures.results, setup.server
    print(f"\nBatch API burst: {args.batches} batches x {args.lines} lines (max_tokens {args.max_tokens}) created at once "
          f"over {args.tenants} tenants, {args.rounds} round(s); cpu count {os.cpu_count()}; load {setup.load_start} -> {figures.load_end}")
    print(f"warm engine start (untimed): {server.start_s:.1f} s to healthy, first request {server.first_request_s:.2f} s")
    rh = "".join(f"{'round ' + str(i + 1) + ' s':>11}" for i in range(args.rounds))
    print(f"{'system':<11}{rh}{'first s':>9}{'batch med':>10}{'queued med':>11}{'infer step':>11}{'steps sum':>10}"
          f"{'model load':>11}{'answering':>10}{'engine cpu':>11}")
    for system in SYSTEMS:
        rs = results[system]
        print(f"{system:<11}" + "".join(f"{x['last_done_s']:>11.1f}" for x in rs)
              + f"{med([x['first_done_s'] for x in rs]):>9.1f}{med([x['batch_done_s_median'] for x in rs]):>10.1f}"
              f"{med([x['queued_s_median'] for x in rs]):>11.1f}{med([x['infer_step_s_median'] for x in rs]):>11.2f}"
              f"{med([x['infer_step_s_sum'] for x in rs]):>10.1f}{med([x['model_load_s_median'] for x in rs]):>11.2f}"
              f"{med([x['answering_s_median'] for x in rs]):>10.2f}{med([x['server_cpu_s'] for x in rs]):>11.1f}")
    ratios = [round(i["last_done_s"] / w["last_done_s"], 2) for i, w in zip(results["in_process"], results["warm"])]
    verdict = "MET" if statistics.median(ratios) >= 3 else "NOT MET"
    print(f"in_process / warm, last completed: {', '.join(f'{x:.2f}x' for x in ratios)} (per round); "
          f"issue 37's target >= 3x: {verdict}")
    print("  (seconds from the first create; 'infer step' the median run's inference_results step (it holds the gpu pool "
          "slot in-process only); 'steps sum' all of them, against the wall time; model load and answering: metrics.json, "
          "medians (warm answering: its token share of the engine's time); engine cpu: the warm server's CPU s in the burst)")
    print(f"answers equal, warm vs in_process: {', '.join(f'{e}/{args.batches * args.lines}' for e in equal)} (per round)")
    for system in SYSTEMS:
        for x in results[system]:
            print(f"  {system} round {x['round']}: all created {x['all_created_s']:.1f} s; first run's creation to first "
                  f"inference step {x['before_first_infer_s']:.1f} s; first inference step start to last end "
                  f"{x['infer_span_s']:.1f} s; load {x['load_before']} -> {x['load_after']}")
    return {"burst_ratio_per_round": ratios, "burst_target_met": verdict == "MET"}


def _print_priority(args: argparse.Namespace, prio: list[dict[str, Any]]) -> dict[str, Any]:
    """The priority runs' table; the summary of its target."""
    print(f"\nPriority on the warm engine: bulk {args.bulk_lines} x {args.bulk_max_tokens} tokens (tenant bulk), urgent "
          f"{args.lines} x {args.max_tokens} with metadata priority {URGENT_PRIORITY} (tenant urgent)")
    print(f"{'round':<7}{'urgent beside bulk s':>21}{'urgent alone s':>15}{'ratio':>7}{'bulk s':>8}"
          f"{'bulk answered then':>20}{'urgent waited for pool':>23}")
    for x in prio:
        print(f"{x['round']:<7}{x['urgent_beside_bulk_s']:>21.1f}{x['urgent_alone_s']:>15.1f}{x['ratio']:>6.2f}x"
              f"{x['bulk_s']:>8.1f}{x['bulk_answered_when_urgent_created']:>13}/{args.bulk_lines:<6}"
              f"{'yes' if x['urgent_infer_waited_for_bulk'] else 'no':>23}")
        print(f"  relative to the end of the bulk's inference step: the urgent run started "
              f"{x['urgent_run_start_after_bulk_infer_end_s']:+.1f} s, its inference step "
              f"{x['urgent_infer_start_after_bulk_infer_end_s']:+.1f} s; inference steps: urgent "
              f"{x['urgent_infer_step_s']} s, alone {x['alone_infer_step_s']} s, bulk {x['bulk_infer_step_s']} s")
        for kind in ("urgent", "alone"):
            print(f"  {kind:<6} " + ", ".join(f"{k} {v:.2f}" for k, v in x["phases"][kind].items()) + " s")
        print(f"  load {x['load_before']} -> {x['load_mid']} -> {x['load_after']}")
    pr_ratio = statistics.median(x["ratio"] for x in prio)
    print(f"urgent beside bulk / alone: {pr_ratio:.2f}x; target <= 1.5x: {'MET' if pr_ratio <= 1.5 else 'NOT MET'}")
    return {"priority_ratio": pr_ratio, "priority_target_met": pr_ratio <= 1.5}


def _write_json(args: argparse.Namespace, setup: _Setup, figures: _Figures, equal: list[int],
                summary: dict[str, Any]) -> None:
    for rs in figures.results.values():
        for x in rs:
            x.pop("texts", None)
    server = setup.server
    args.json.write_text(json.dumps({
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": str(setup.model_dir), "warm_engine": {"start_to_healthy_s": server.start_s, "first_request_s":
                                                       server.first_request_s, "command": server.command},
        "loadavg_start": setup.load_start, "loadavg_end": figures.load_end, "burst": figures.results,
        "priority": figures.prio, "answers_equal": equal, "summary": summary}, indent=2))
    say(f"wrote {args.json}")


def main() -> int:
    args = parse_args()
    setup = _prepare(args)
    figures = _measure(args, setup)
    equal = [] if args.priority_only else _answers_equal(figures.results)
    summary = {} if args.priority_only else _print_burst(args, setup, figures, equal)
    if figures.prio:
        summary.update(_print_priority(args, figures.prio))
    if args.json:
        _write_json(args, setup, figures, equal, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

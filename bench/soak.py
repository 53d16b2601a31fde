#!/usr/bin/env python3
"""The pipeline answering for an hour (issue 26's soak): memory, open files and threads of every
long-lived process, sampled every minute, with a least-squares slope per process.

A script, not a test. From the repository root:

    nice -n 19 .venv/bin/python bench/soak.py --minutes 60 --json /tmp/soak.json   # the issue's hour
    .venv/bin/python bench/soak.py --minutes 3 --batch-every 30 --sample-every 30  # a smoke run, ~5 min

What runs, all on 127.0.0.1, as the API tests start them (batch_pipeline_tests/support/api_service.py):

- a real `dagster dev` (web server, daemon, code server; the repo's dagster.yaml: SQLite, the queued
  run coordinator, the `gpu` pool) on a fresh DAGSTER_HOME, with the tests' tiny random Llama
  (`tiny-llama`, built once into .cache/test-models: the model is loaded by each run worker, which
  the soak does not sample, so its size changes little here);
- one `batch-pipeline serve` over it (tenant `soak`);
- this process, a client as a tenant and Prometheus would be: every `--batch-every` seconds (60) it
  uploads a file of `--lines` (8) chat requests (`--max-tokens` 16, ignore_eos) and creates a batch,
  unless `--max-open` (2) of its batches are still unfinished (the tick is then counted as skipped,
  so a slow machine does not grow a queue the soak would then measure); every 10 s it retrieves its
  unfinished batches; every minute it lists the first page of its batches and scrapes /metrics.

Every `--sample-every` seconds (60) it samples, with psutil, each process of the `dagster dev` tree
and `batch-pipeline serve`: resident memory (RSS), open file descriptors and threads. Run workers
(one per batch: the code server spawns it through multiprocessing, and it starts its compute-log
tails) come and go with their runs and are counted, not sampled: the soak is about what stays up. A process that is replaced (a new pid
under the same role) is reported. At the end it prints a table per process (first, last and max of
each figure, and the least-squares slope per hour over every sample and over the second half: a leak
is a slope that does not flatten), the batches (created, completed, failed, time from create to
completed), the load average at each sample, and writes all of it as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TENANT, KEY = "soak", "soak-key-0123456789abcdef"
TERMINAL = ("completed", "failed", "cancelled", "expired")


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None under 3 points."""
    if len(points) < 3:
        return None
    xs = [t / 3600 for t, _ in points]
    ys = [v for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


# ------------------------------------------------------------------------------ the processes


def role(cmdline: list[str]) -> str:
    """A long-lived process's role from its command line (the web server's and the daemon's name
    --code-server-log-level: they are matched first)."""
    text = " ".join(cmdline)
    for needle, name in (("batch-pipeline serve", "batch-api (serve)"), ("dagster_webserver", "webserver"),
                         ("dagster-webserver", "webserver"), ("dagster._daemon", "daemon"),
                         ("dagster-daemon", "daemon"), ("api grpc", "code server (grpc)"),
                         ("code-server start", "code server (proxy)"), ("dagster dev", "dagster dev"),
                         ("resource_tracker", "resource tracker")):
        if needle in text:
            return name
    return " ".join(Path(part).name for part in cmdline[:2])[:30] if cmdline else "?"


def is_run_worker(cmdline: list[str]) -> bool:
    """A run's worker: the code server starts each run in a process of its own, through
    multiprocessing's spawn (`-c "from multiprocessing.spawn import spawn_main ..."`), or as
    `dagster api execute_run` with other launchers."""
    text = " ".join(cmdline)
    return "spawn_main" in text or "multiprocessing-fork" in text or "execute_run" in text


def long_lived(roots: list[int]) -> tuple[dict[str, Any], int]:
    """({role: psutil.Process} of the trees under `roots`, run workers and their children left out;
    the number of run workers alive)."""
    import psutil

    found: dict[str, list[Any]] = {}
    workers = 0
    stack = []
    for pid in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            stack.append(psutil.Process(pid))
    while stack:
        process = stack.pop()
        try:
            cmdline = process.cmdline()
            children = process.children()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if is_run_worker(cmdline):
            workers += 1
            continue
        found.setdefault(role(cmdline), []).append(process)
        stack.extend(children)
    # One of a kind: its role; several (or an unknown kind): role and pid, stable from sample to sample.
    named = {}
    for name, processes in found.items():
        for process in processes:
            named[name if len(processes) == 1 else f"{name} {process.pid}"] = process
    return named, workers


def sample(processes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import psutil

    figures = {}
    for name, process in processes.items():
        try:
            with process.oneshot():
                figures[name] = {"pid": process.pid, "rss_mb": round(process.memory_info().rss / 2**20, 2),
                                 "fds": process.num_fds(), "threads": process.num_threads()}
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return figures


# ------------------------------------------------------------------------------- the client


class Client:
    """The tenant's side: batches created, followed to their end; what went wrong, counted."""

    def __init__(self, base: str, lines: int, max_tokens: int) -> None:
        from batch_pipeline_tests.support.api_service import client

        self.base = base
        self.sdk = client(f"{base}/v1", KEY)
        self.lines, self.max_tokens = lines, max_tokens
        self.batches: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, int] = {}
        self.skipped = 0

    def _error(self, what: str, e: BaseException) -> None:
        key = f"{what}: {type(e).__name__}"
        self.errors[key] = self.errors.get(key, 0) + 1
        say(f"  {key}: {str(e)[:200]}")

    def open(self) -> list[str]:
        return [i for i, b in self.batches.items() if b["status"] not in TERMINAL]

    def create(self, max_open: int) -> None:
        from batch_pipeline_tests.support.api_service import request_line, upload

        if len(self.open()) >= max_open:
            self.skipped += 1
            return
        n = len(self.batches)
        try:
            source = upload(self.sdk, [request_line(f"b{n}-q{i}", f"soak batch {n} question {i}", self.max_tokens)
                                       for i in range(self.lines)], name=f"soak-{n}.jsonl")
            batch = self.sdk.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        except Exception as e:  # noqa: BLE001 - counted, the soak goes on
            self._error("create", e)
            return
        self.batches[batch.id] = {"created": time.time(), "status": batch.status, "done": None, "counts": None}

    def poll(self) -> None:
        for batch_id in self.open():
            try:
                batch = self.sdk.batches.retrieve(batch_id)
            except Exception as e:  # noqa: BLE001
                self._error("retrieve", e)
                continue
            entry = self.batches[batch_id]
            entry["status"] = batch.status
            if batch.status in TERMINAL:
                entry["done"] = time.time()
                entry["counts"] = batch.request_counts.model_dump() if batch.request_counts else None

    def list_and_scrape(self) -> None:
        try:
            self.sdk.batches.list(limit=20)
        except Exception as e:  # noqa: BLE001
            self._error("list", e)
        try:
            request = urllib.request.Request(f"{self.base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        except Exception as e:  # noqa: BLE001
            self._error("metrics", e)

    def summary(self) -> dict[str, Any]:
        by_status: dict[str, int] = {}
        for b in self.batches.values():
            by_status[b["status"]] = by_status.get(b["status"], 0) + 1
        turnaround = sorted(b["done"] - b["created"] for b in self.batches.values()
                            if b["status"] == "completed" and b["done"])
        lines = {"completed": 0, "failed": 0}
        for b in self.batches.values():
            for k in lines:
                lines[k] += (b["counts"] or {}).get(k, 0)
        return {"created": len(self.batches), "by_status": by_status, "skipped_ticks": self.skipped,
                "lines": lines, "errors": self.errors,
                "create_to_completed_s": {"p50": statistics.median(turnaround), "max": max(turnaround)}
                if turnaround else None}


# ------------------------------------------------------------------------------------ main


def report(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process: first, last, max and the slopes (all samples; the second half) of each figure."""
    names: list[str] = []
    for s in samples:
        names += [n for n in s["processes"] if n not in names]
    rows = []
    for name in names:
        series = [(s["t"], s["processes"][name]) for s in samples if name in s["processes"]]
        pids = sorted({p["pid"] for _, p in series})
        row: dict[str, Any] = {"process": name, "pids": pids, "samples": len(series)}
        half = series[0][0] + (series[-1][0] - series[0][0]) / 2
        for figure in ("rss_mb", "fds", "threads"):
            points = [(t, p[figure]) for t, p in series]
            row[figure] = {"first": points[0][1], "last": points[-1][1], "max": max(v for _, v in points),
                           "slope_per_h": slope_per_hour(points),
                           "slope_per_h_2nd_half": slope_per_hour([pt for pt in points if pt[0] >= half])}
        rows.append(row)
    return rows


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


@dataclass
class _Setup:
    """The soak's work folder, the pipeline's environment and the settings it reports."""

    work: Path
    env: dict[str, str | None]  # the pipeline's variables (None: unset), as the test support makes them
    settings: dict[str, Any]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the pipeline answers (sampling)")
    parser.add_argument("--batch-every", type=float, default=60.0, help="seconds between batches created")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--lines", type=int, default=8, help="requests per batch")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates (ignore_eos)")
    parser.add_argument("--max-open", type=int, default=2, help="create nothing while this many batches are unfinished")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a new folder under $TMPDIR")
    parser.add_argument("--json", type=Path, default=None, help="write every sample and the table here")
    return parser.parse_args()


def _prepare(args: argparse.Namespace) -> _Setup:
    """The runtime environment, the work folder, the tiny model, the pipeline's variables."""
    from batch_pipeline.base.runtime import configure_runtime_env
    from batch_pipeline.config import models
    from batch_pipeline_tests.support import TINY_NAME
    from batch_pipeline_tests.support.dagster_server import pipeline_env
    from batch_pipeline_tests.support.tiny_model import build_tiny_llama

    configure_runtime_env(models.cache_root())  # as the tests' session: vLLM's caches, the in-process engine core
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "in").mkdir(exist_ok=True)
    model_dir = build_tiny_llama(models.cache_root() / "test-models" / TINY_NAME)
    env = pipeline_env(model_dir, str(work / "in"), str(work / "out"))
    for name in [n for n in os.environ if n.startswith("BATCH_API_")]:
        env[name] = None
    settings = {"minutes": args.minutes, "batch_every_s": args.batch_every, "sample_every_s": args.sample_every,
                "lines": args.lines, "max_tokens": args.max_tokens, "max_open": args.max_open, "model": TINY_NAME,
                "niceness": os.nice(0), "cpu_count": os.cpu_count(), "work_dir": str(work)}
    return _Setup(work=work, env=env, settings=settings)


def _take_sample(roots: list[int], tenant: Client, elapsed: float) -> dict[str, Any]:
    """One sample of the long-lived processes under `roots`, said in the log."""
    processes, workers = long_lived(roots)
    taken = {"t": round(elapsed, 1), "at": time.strftime("%H:%M:%S", time.gmtime()),
             "load": loadavg(), "run_workers": workers, "processes": sample(processes)}
    summary = ", ".join(f"{n} {p['rss_mb']:.0f} MB/{p['fds']} fd/{p['threads']} thr"
                        for n, p in taken["processes"].items())
    done = sum(1 for b in tenant.batches.values() if b["status"] in TERMINAL)
    say(f"t={taken['t'] / 60:5.1f} min load {taken['load'][0]:.1f} batches {len(tenant.batches)} "
        f"({done} done) workers {workers}: {summary}")
    return taken


def _answer(args: argparse.Namespace, settings: dict[str, Any], roots: list[int], tenant: Client) -> list[dict[str, Any]]:
    """--minutes of batches created, followed and scraped, the processes sampled; every sample."""
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    end = started + args.minutes * 60
    next_sample = next_batch = next_poll = next_scrape = started
    while True:
        now = time.monotonic()
        if now >= next_sample:
            samples.append(_take_sample(roots, tenant, now - started))
            next_sample += args.sample_every
            if args.json:  # as it goes: a run stopped early keeps its samples
                args.json.write_text(json.dumps({"settings": settings, "samples": samples}, indent=1))
            if now >= end:
                break
        if now >= next_batch and now < end:
            tenant.create(args.max_open)
            next_batch += args.batch_every
        if now >= next_poll:
            tenant.poll()
            next_poll = time.monotonic() + 10
        if now >= next_scrape:
            tenant.list_and_scrape()
            next_scrape += 60
        wake = min(next_sample, next_poll, next_scrape, next_batch if next_batch < end else next_sample)
        time.sleep(min(10.0, max(0.0, wake - time.monotonic())))
    tenant.poll()
    return samples


def _soak(args: argparse.Namespace, setup: _Setup) -> tuple[list[dict[str, Any]], Client]:
    """Start `dagster dev` and `batch-pipeline serve`, soak, stop both; the samples and the tenant."""
    from batch_pipeline_tests.support.api_service import Serve, serve_env
    from batch_pipeline_tests.support.dagster_server import start_dagster_dev

    work, env = setup.work, setup.env
    say(f"settings {setup.settings}; load {loadavg()}")
    server = start_dagster_dev(work / "home", env, work / "dagster-dev.log")
    api = None
    try:
        api = Serve(serve_env({**env, "DAGSTER_HOME": str(work / "home"), "DAGSTER_WEBSERVER_URL": server.url,
                               "BATCH_API_KEYS": f"{TENANT}:{KEY}"}), work / "serve.log").start()
        tenant = Client(api.base, args.lines, args.max_tokens)
        say(f"up: dagster dev {server.url}, Batch API {api.base}; load {loadavg()}")
        samples = _answer(args, setup.settings, [server.process.pid, api.process.pid], tenant)
    finally:
        if api is not None:
            api.stop()
        server.stop()
    return samples, tenant


def _print_table(args: argparse.Namespace, settings: dict[str, Any], samples: list[dict[str, Any]],
                 rows: list[dict[str, Any]], batches: dict[str, Any]) -> None:
    """The soak's settings, a row per process, the batches."""
    loads = [s["load"][0] for s in samples]
    print(f"\nSoak: {args.minutes:g} min, {len(samples)} samples every {args.sample_every:g} s, model {settings['model']}, "
          f"a batch of {args.lines} x {args.max_tokens} tokens every {args.batch_every:g} s (at most {args.max_open} "
          f"unfinished); nice {settings['niceness']}; {os.cpu_count()} cores; load average (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}, median {statistics.median(loads):.1f}; one run")
    print(f"{'process':<20} {'pids':>4}  {'RSS MB first/last/max':<22} {'MB/h all; 2nd half':<18}  "
          f"{'fds f/l/max':<12} {'fds/h':<13}  {'threads f/l/max':<15} {'threads/h':<13}")
    for r in rows:
        cells = []
        for figure, digits in (("rss_mb", 1), ("fds", 0), ("threads", 0)):
            f = r[figure]
            span = (f"{f['first']:.1f}/{f['last']:.1f}/{f['max']:.1f}" if digits else f"{f['first']}/{f['last']}/{f['max']}")
            cells.append((span, f"{fmt(f['slope_per_h'])}; {fmt(f['slope_per_h_2nd_half'])}"))
        (rss, rss_h), (fds, fds_h), (thr, thr_h) = cells
        print(f"{r['process']:<20} {len(r['pids']):>4}  {rss:<22} {rss_h:<18}  {fds:<12} {fds_h:<13}  {thr:<15} {thr_h:<13}")
    print(f"batches: {json.dumps(batches)}")


def main() -> int:
    args = parse_args()
    os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))
    setup = _prepare(args)
    samples, tenant = _soak(args, setup)
    rows = report(samples)
    batches = tenant.summary()
    _print_table(args, setup.settings, samples, rows, batches)
    if args.json:
        args.json.write_text(json.dumps({"settings": setup.settings, "processes": rows, "batches": batches,
                                         "samples": samples}, indent=2))
        say(f"written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

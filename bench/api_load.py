#!/usr/bin/env python3
"""The Batch API under load: create, retrieve, list and content at 1, 8, 32 and 128 concurrent
clients, on a store that already holds 10,000 past batches; p50/p99 latency and errors per level.

A script, not a test. From the repository root:

    .venv/bin/python bench/api_load.py                                   # the issue's sizes, one run
    .venv/bin/python bench/api_load.py --levels 1,8 --history 1000 --min-samples 16   # a smoke run
    .venv/bin/python bench/api_load.py --ops retrieve,list,content --json /tmp/api-load.json

What runs, all on 127.0.0.1:

- a Dagster web server (`dagster-webserver`, the repo's dagster.yaml: SQLite, queued runs) with no
  daemon: every batch created is a real run submission over GraphQL that stays QUEUED, so no run
  worker or model competes with the service for the cores;
- `batch-pipeline serve` (one uvicorn process, as deployed) on a local STORAGE_OUTPUT_PATH holding
  `--history` finished batches of tenant `history` (records and the pipeline's batch.json and
  output.jsonl, written as the service and the pipeline write them: batch_pipeline_tests/support/api_history.py);
- this process: `level` asyncio clients (httpx, one connection each) per level, each doing its share
  of `max(1, ceil(min_samples / level))` requests of one operation, then the next operation:
    create    POST /v1/batches (tenant `creator`, one uploaded file): the record, the turn query
              (the API's queued and running runs) and the run submission to Dagster; with
              --in-flight-limit N also the limit check, which asks Dagster for the run of each of the
              tenant's open batches (here every batch created so far: no daemon, none finishes);
    retrieve  GET /v1/batches/{id} of a random past batch;
    list      GET /v1/batches?limit=20 (tenant `history`: the first page of its 10,000);
    list_after  GET /v1/batches?limit=20&after=<a random past batch>: a page anywhere in the history;
    content   GET /v1/files/file-<id>-output/content of a random past batch.
  Latency is from send to the last byte; an error is a non-2xx answer or a transport error/timeout.

Creates go to a tenant of their own so that the list, retrieve and content figures stay those of
the history (a created batch stays QUEUED: listing it asks Dagster for its run). A list reads the
tenant's listing index (names) and one page of records; the service indexes the history's records
(written without listing markers, as an older service wrote them) once when it starts, before the
first measured request.
The client shares the 2 cores with the server: figures are the service and its client together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))
from common import loadavg, pct, say  # noqa: E402

KEYS = {"history": "history-key-0123456789", "creator": "creator-key-0123456789"}
OPS = ("create", "retrieve", "list", "list_after", "content")


def wait_http(url: str, timeout: float, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}: not up after {timeout:.0f}s\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 15)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


async def one_level(base: str, level: int, op: str, samples: int, past: list[str], input_file_id: str,
                    timeout: float) -> dict[str, Any]:
    import httpx

    per_client = max(1, math.ceil(samples / level))
    latencies: list[float] = []
    errors: dict[str, int] = {}

    def request(client: Any) -> Any:
        if op == "create":
            return client.post("/v1/batches", headers={"Authorization": f"Bearer {KEYS['creator']}"},
                               json={"input_file_id": input_file_id, "endpoint": "/v1/chat/completions",
                                     "completion_window": "24h"})
        auth = {"Authorization": f"Bearer {KEYS['history']}"}
        if op == "retrieve":
            return client.get(f"/v1/batches/{random.choice(past)}", headers=auth)
        if op == "list":
            return client.get("/v1/batches", params={"limit": 20}, headers=auth)
        if op == "list_after":  # a page anywhere in the history
            return client.get("/v1/batches", params={"limit": 20, "after": random.choice(past)}, headers=auth)
        return client.get(f"/v1/files/file-{random.choice(past)}-output/content", headers=auth)

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=timeout,
                                     limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
            for _ in range(per_client):
                started = time.perf_counter()
                try:
                    response = await request(client)
                    await response.aread()
                    if response.status_code >= 300:
                        errors[f"HTTP {response.status_code}"] = errors.get(f"HTTP {response.status_code}", 0) + 1
                        continue
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    continue
                latencies.append(time.perf_counter() - started)

    load_before = loadavg()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(level)))
    wall = time.perf_counter() - started
    n = per_client * level
    return {"level": level, "op": op, "requests": n, "ok": len(latencies), "errors": sum(errors.values()),
            "error_kinds": errors, "wall_s": wall, "per_s": n / wall,
            "p50_ms": 1000 * pct(latencies, 50) if latencies else None,
            "p99_ms": 1000 * pct(latencies, 99) if latencies else None,
            "mean_ms": 1000 * statistics.fmean(latencies) if latencies else None,
            "load_before": load_before, "load_after": loadavg()}


@dataclass
class _Servers:
    """The Dagster web server and `batch-pipeline serve`, started, with their logs."""

    webserver: subprocess.Popen
    dagster_port: int
    dagster_log: Path
    serve: subprocess.Popen
    serve_log: Path
    base: str  # the Batch API's URL

    def wait_up(self) -> None:
        wait_http(f"http://127.0.0.1:{self.dagster_port}/server_info", 180, self.webserver, self.dagster_log)
        wait_http(f"{self.base}/ready", 120, self.serve, self.serve_log)

    def stop(self) -> None:
        stop(self.serve)
        stop(self.webserver)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32,128", help="concurrent clients, comma-separated")
    parser.add_argument("--ops", default=",".join(OPS), help=f"operations, in this order at each level: {OPS}")
    parser.add_argument("--history", type=int, default=10_000, help="past batches in the store")
    parser.add_argument("--min-samples", type=int, default=64,
                        help="requests per operation and level at least (each client does its share)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--in-flight-limit", type=int, default=None,
                        help="BATCH_API_MAX_IN_FLIGHT for the service (default: unset, no limit check at create)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a new folder under $TMPDIR")
    parser.add_argument("--json", type=Path, default=None, help="write every level's figures here")
    return parser.parse_args()


def _write_history(args: argparse.Namespace, out: Path) -> list[str]:
    """--history past batches of tenant `history` under `out`; their ids."""
    from batch_pipeline_tests.support import TINY_NAME
    from batch_pipeline_tests.support.api_history import write_history

    say(f"writing {args.history} past batches under {out}")
    started = time.perf_counter()
    past = [r["id"] for r in write_history(out, args.history, ["history"], model=TINY_NAME)]
    say(f"  {time.perf_counter() - started:.1f} s")
    return past


def _start_servers(args: argparse.Namespace, work: Path, out: Path) -> _Servers:
    """Start the web server (no daemon) and `batch-pipeline serve` over the store `out`."""
    from batch_pipeline.config import models
    from batch_pipeline_tests.support import TINY_NAME
    from batch_pipeline_tests.support.dagster_server import free_port, pipeline_env, prepare_home
    from batch_pipeline_tests.support.tiny_model import build_tiny_llama

    # The web server loads the code location (the job's config schema for submissions): the tiny
    # model's folder is named, never loaded (no daemon, so no run starts).
    model_dir = build_tiny_llama(models.cache_root() / "test-models" / TINY_NAME)
    extra = pipeline_env(model_dir, str(work / "in"), str(out))
    env = {k: v for k, v in {**os.environ, **extra}.items() if v is not None}
    home = prepare_home(work / "home")
    env["DAGSTER_HOME"] = str(home)
    bin_dir = Path(sys.executable).parent
    dagster_port, api_port = free_port(), free_port()
    dagster_log, serve_log = work / "webserver.log", work / "serve.log"
    with open(dagster_log, "wb") as log:
        webserver = subprocess.Popen([str(bin_dir / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1",
                                      "-p", str(dagster_port)], cwd=REPO, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    serve_env = {**env, "DAGSTER_WEBSERVER_URL": f"http://127.0.0.1:{dagster_port}",
                 "BATCH_API_KEYS": ",".join(f"{t}:{k}" for t, k in KEYS.items())}
    for name in ("BATCH_API_AUDIT_LOG", "BATCH_API_TENANT_LIMITS", "BATCH_API_KEYS_FILE", "BATCH_API_MAX_IN_FLIGHT"):
        serve_env.pop(name, None)
    if args.in_flight_limit:
        serve_env["BATCH_API_MAX_IN_FLIGHT"] = str(args.in_flight_limit)
    with open(serve_log, "wb") as log:
        serve = subprocess.Popen([str(bin_dir / "batch-pipeline"), "serve", "--port", str(api_port)], cwd=REPO,
                                 env=serve_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return _Servers(webserver=webserver, dagster_port=dagster_port, dagster_log=dagster_log, serve=serve,
                    serve_log=serve_log, base=f"http://127.0.0.1:{api_port}")


def _warm_up(base: str, past: list[str]) -> str:
    """Upload the creates' input file; one create and one of each read, not measured; the file's id."""
    import httpx

    from batch_pipeline_tests.support import TINY_NAME

    upload = httpx.post(f"{base}/v1/files", headers={"Authorization": f"Bearer {KEYS['creator']}"},
                        data={"purpose": "batch"}, timeout=60,
                        files={"file": ("load.jsonl", json.dumps({
                            "custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4}}) + "\n")})
    upload.raise_for_status()
    input_file_id = upload.json()["id"]
    # Warm-up, not measured: the web server loads the code location after it answers, and a
    # submission before that fails; one create once it is loaded (and one of each read).
    deadline = time.monotonic() + 180
    while True:
        warm = httpx.post(f"{base}/v1/batches", headers={"Authorization": f"Bearer {KEYS['creator']}"}, timeout=60,
                          json={"input_file_id": input_file_id, "endpoint": "/v1/chat/completions",
                                "completion_window": "24h"})
        if warm.status_code == 200:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"create never succeeded: {warm.status_code} {warm.text[:300]}")
        time.sleep(2)
    auth = {"Authorization": f"Bearer {KEYS['history']}"}
    for path in (f"/v1/batches/{past[0]}", "/v1/batches?limit=20", f"/v1/files/file-{past[0]}-output/content"):
        httpx.get(f"{base}{path}", headers=auth, timeout=120).raise_for_status()
    return input_file_id


def _measure(args: argparse.Namespace, servers: _Servers, levels: list[int], ops: list[str],
             past: list[str]) -> list[dict[str, Any]]:
    """Wait for the servers, warm up, then every operation at every level; stop the servers."""
    results: list[dict[str, Any]] = []
    try:
        servers.wait_up()
        input_file_id = _warm_up(servers.base, past)
        say(f"service up (load {loadavg()}); levels {levels}, ops {ops}")
        for level in levels:
            for op in ops:
                figures = asyncio.run(one_level(servers.base, level, op, args.min_samples, past, input_file_id,
                                                args.timeout))
                results.append(figures)
                say(f"  {level:>4} clients {op:<8} n={figures['requests']:<4} p50 {figures['p50_ms'] or 0:8.1f} ms "
                    f"p99 {figures['p99_ms'] or 0:8.1f} ms errors {figures['errors']} "
                    f"({figures['per_s']:.1f}/s; load {figures['load_after']})")
    finally:
        servers.stop()
    return results


def _report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    print(f"\nBatch API load: {args.history} past batches in the store, one `batch-pipeline serve` process, "
          f"Dagster web server without daemon; cpu count {os.cpu_count()}; one run")
    print(f"{'clients':>7} {'op':<8} {'requests':>8} {'p50 ms':>9} {'p99 ms':>9} {'errors':>6} {'req/s':>7}  load (1/5/15 min, after)")
    for r in results:
        p50 = f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-"
        p99 = f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-"
        print(f"{r['level']:>7} {r['op']:<8} {r['requests']:>8} {p50:>9} {p99:>9} {r['errors']:>6} "
              f"{r['per_s']:>7.1f}  {r['load_after']}" + (f"  {r['error_kinds']}" if r["errors"] else ""))


def main() -> int:
    args = parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    ops = [op for op in args.ops.split(",") if op]
    assert set(ops) <= set(OPS), f"--ops: {set(ops) - set(OPS)} unknown"

    os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="api-load-"))
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    past = _write_history(args, out)
    results = _measure(args, _start_servers(args, work, out), levels, ops, past)
    _report(args, results)
    if args.json:
        args.json.write_text(json.dumps({"history": args.history, "levels": levels, "results": results}, indent=2))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

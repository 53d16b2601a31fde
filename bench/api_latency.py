#!/usr/bin/env python3
"""The Batch API's added latency: create to completed through `batch-pipeline serve` and a real
`dagster dev`, against `batch-pipeline run` on the same file, measured in one run.

A script, not a test. From the repository root:

    .venv/bin/python bench/api_latency.py                          # 32 x 16 on the tiny test model, 2 rounds
    .venv/bin/python bench/api_latency.py --num-requests 64 --output-len 32 --repeats 3 --json /tmp/api.json

Once: a `dagster dev` (web server, daemon, code server; the repo's dagster.yaml: SQLite, queued runs)
and a `batch-pipeline serve` in front of it. Then per round, alternating so machine noise hits both:

- cli: `batch-pipeline run FILE --output-dir DIR` as a new process, wall time from start to exit;
- api: with the unmodified openai SDK, files.create + batches.create, then batches.retrieve every
  0.25 s; wall time from the upload to the first poll that answers `completed`.

Both load the model in a fresh process (the CLI, or the run worker the daemon launches) with the same
engine settings, and answer the same lines. What the API adds: the upload, the submission over
GraphQL, the daemon's queue (it dequeues on a short beat), the run worker's start-up, and the polling
interval. The Batch object's own timestamps (created, in progress, completed; whole seconds) split
that wait and are printed too. The tiny random Llama keeps the inference short, so the fixed costs
are what is measured; with a real model the same seconds are a smaller share.
"""

from __future__ import annotations

import argparse
import json
import os
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

KEY = "bench-key-0123456789"


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def workload(path: Path, model: str, n: int, output_len: int) -> None:
    lines = []
    for i in range(n):
        body = {"model": model, "messages": [{"role": "user", "content": f"Question {i}: say something."}],
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    path.write_text("\n".join(lines) + "\n")


def run_cli(cli: str, workload_path: Path, out: Path, env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    cli_env = {k: v for k, v in env.items() if k != "DAGSTER_HOME"}  # an ephemeral instance, as users run it
    started = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.run([cli, "run", str(workload_path), "--output-dir", str(out)], env=cli_env, cwd=REPO,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"batch-pipeline run exited {proc.returncode}; see {log}")
    batch = json.loads((out / "batch.json").read_text())
    return {"wall_s": wall, "status": batch["status"], "completed": batch["request_counts"]["completed"]}


def run_api(sdk: Any, workload_path: Path, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    uploaded = sdk.files.create(file=(workload_path.name, workload_path.read_bytes()), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    submitted = time.perf_counter() - started
    deadline = started + timeout
    while True:
        current = sdk.batches.retrieve(batch.id)
        if current.status in ("completed", "failed", "cancelled", "expired"):
            break
        if time.perf_counter() > deadline:
            raise TimeoutError(f"batch {batch.id} still {current.status} after {timeout:.0f}s")
        time.sleep(0.25)
    wall = time.perf_counter() - started
    if current.status != "completed":
        raise RuntimeError(f"batch {batch.id} ended {current.status}: {current.errors}")
    return {"wall_s": wall, "submit_s": submitted, "status": current.status,
            "completed": current.request_counts.completed, "batch_id": batch.id,
            # The Batch object's own clock (whole seconds): queue + run start, then the run itself.
            "queued_s": (current.in_progress_at or current.created_at) - current.created_at,
            "in_progress_s": (current.completed_at or 0) - (current.in_progress_at or current.created_at)}


@dataclass
class _Setup:
    """What every round uses: the work folder, the file both systems answer, the environment, the CLI."""

    work: Path
    workload_path: Path
    extra: dict[str, str | None]  # the pipeline's variables, as the test support makes them
    env: dict[str, str]  # this process's environment with `extra`
    cli: str  # the batch-pipeline executable next to this interpreter


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each one cli and one api run")
    parser.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a new folder under $TMPDIR")
    parser.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    return parser.parse_args()


def _prepare(args: argparse.Namespace) -> _Setup:
    """The work folder, the tiny model, the workload file and the environment."""
    from batch_pipeline.config import models
    from batch_pipeline_tests.support import TINY_NAME
    from batch_pipeline_tests.support.dagster_server import pipeline_env
    from batch_pipeline_tests.support.tiny_model import build_tiny_llama

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="api-latency-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_llama(models.cache_root() / "test-models" / TINY_NAME)
    workload_path = work / "workload.jsonl"
    workload(workload_path, TINY_NAME, args.num_requests, args.output_len)
    extra = pipeline_env(model_dir, str(work / "in"), str(work / "out"))
    env = {k: v for k, v in {**os.environ, **extra}.items() if v is not None}
    cli = str(Path(sys.executable).with_name("batch-pipeline"))
    return _Setup(work=work, workload_path=workload_path, extra=extra, env=env, cli=cli)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _run_round(args: argparse.Namespace, setup: _Setup, sdk: Any, round_: int) -> list[dict[str, Any]]:
    """One cli run, then one api run; each run's figures."""
    runs = []
    for system in ("cli", "api"):
        load = os.getloadavg()[0]
        say(f"round {round_ + 1}/{args.repeats}: {system} (load {load:.1f})")
        if system == "cli":
            out = setup.work / f"cli-{round_}"
            result = run_cli(setup.cli, setup.workload_path, out, setup.env, setup.work / f"cli-{round_}.log", args.timeout)
        else:
            result = run_api(sdk, setup.workload_path, args.timeout)
        if result["completed"] != args.num_requests:
            raise RuntimeError(f"{system}: {result['completed']} of {args.num_requests} answered")
        runs.append({"system": system, "round": round_, "load_before": load, **result})
        say(f"  {system}: {result['wall_s']:.1f} s")
    return runs


def _measure(args: argparse.Namespace, setup: _Setup) -> list[dict[str, Any]]:
    """Start `dagster dev` and `batch-pipeline serve`, run the rounds, stop both; every run's figures."""
    import openai

    from batch_pipeline_tests.support.dagster_server import free_port, start_dagster_dev, wait_for

    work = setup.work
    say(f"starting dagster dev and batch-pipeline serve in {work}")
    server = start_dagster_dev(work / "home", setup.extra, work / "dagster-dev.log")
    port = free_port()
    serve_env = {**setup.env, "DAGSTER_HOME": str(work / "home"), "DAGSTER_WEBSERVER_URL": server.url,
                 "BATCH_API_KEYS": f"bench:{KEY}"}
    serve_log = open(work / "serve.log", "wb")  # noqa: SIM115 - the child's, closed at the end
    serve = subprocess.Popen([setup.cli, "serve", "--port", str(port)], env=serve_env, cwd=REPO, stdout=serve_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    runs: list[dict[str, Any]] = []
    try:
        wait_for("batch-pipeline serve healthy", lambda: _healthy(port), 120, interval=0.5)
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        for round_ in range(args.repeats):
            runs += _run_round(args, setup, sdk, round_)
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            serve.kill()
        serve_log.close()
        server.stop()
    return runs


def _report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the figures; return the summary."""
    wall = {s: [r["wall_s"] for r in runs if r["system"] == s] for s in ("cli", "api")}
    cli_med, api_med = statistics.median(wall["cli"]), statistics.median(wall["api"])
    api_runs = [r for r in runs if r["system"] == "api"]
    summary = {
        "requests": args.num_requests, "output_len": args.output_len, "rounds": args.repeats,
        "cli_wall_s_median": cli_med, "api_wall_s_median": api_med,
        "added_s": api_med - cli_med, "ratio": api_med / cli_med,
        "api_submit_s_median": statistics.median(r["submit_s"] for r in api_runs),
        "api_queued_s_median": statistics.median(r["queued_s"] for r in api_runs),
        "api_in_progress_s_median": statistics.median(r["in_progress_s"] for r in api_runs),
    }
    print(f"\n{args.num_requests} requests x {args.output_len} output tokens, tiny model, {args.repeats} round(s), "
          f"alternating; cpu count {os.cpu_count()}")
    print(f"{'system':<34} {'wall s med':>10} {'wall s min':>10}  runs")
    print(f"{'batch-pipeline run (new process)':<34} {cli_med:>10.1f} {min(wall['cli']):>10.1f}  "
          + " ".join(f"{w:.1f}" for w in wall["cli"]))
    print(f"{'Batch API, create to completed':<34} {api_med:>10.1f} {min(wall['api']):>10.1f}  "
          + " ".join(f"{w:.1f}" for w in wall["api"]))
    print(f"added by the API: {summary['added_s']:+.1f} s (median), ratio {summary['ratio']:.2f}x")
    print(f"api split (Batch object, whole seconds): upload+create {summary['api_submit_s_median']:.2f} s, "
          f"created->in_progress {summary['api_queued_s_median']:.0f} s, "
          f"in_progress->completed {summary['api_in_progress_s_median']:.0f} s")
    return summary


def main() -> int:
    args = parse_args()
    os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))
    setup = _prepare(args)
    runs = _measure(args, setup)
    summary = _report(args, runs)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))
    if not args.work_dir:
        shutil.rmtree(setup.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

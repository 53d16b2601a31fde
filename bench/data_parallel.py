#!/usr/bin/env python3
"""One batch on 1 engine vs DATA_PARALLEL_SIZE ranks: wall time, phases and rank balance, in one run.

A script, not a test. From the repository root:

    .venv/bin/python bench/data_parallel.py                          # 192 x 32 chat, 1 vs 2 ranks, 2 rounds
    .venv/bin/python bench/data_parallel.py --ranks 1,2 --num-requests 384 --output-len 64 --rounds 1
    .venv/bin/python bench/data_parallel.py --ranks 2 --start-methods forkserver,spawn --num-requests 24 --rounds 3

Each round runs `batch-pipeline run` once per rank count, alternating (1, 2, 1, 2, ...) so machine
noise hits them alike; every run is a new process writing into a fresh folder. Printed per run:
wall time (process start to exit), model load, inference phase, output tokens/s and
`requests_per_rank` from metrics.json, and the CPU time of the run's whole process tree (the
`batch-pipeline run` process, its ranks and the ranks' fork server: this script adopts orphans as a
subreaper and reaps them); then, per rank count, the best wall time and its ratio to one engine's.
With `--start-methods`, each rank count above 1 runs once per RANK_START_METHOD in every round
(forkserver: ranks forked from one process that imported vLLM; spawn: each rank imports it).

On a machine without GPUs each rank is pinned to its own CPU cores (engine/placement.py), so on a
2-core machine 2 ranks split the same 2 cores one engine had: no speed-up is expected there; the
figures show the cost of the extra process and the balance. On a GPU server each rank has its own
GPU and the inference phase shrinks about linearly (docs/GPU.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CACHE, REPO, say  # noqa: E402
from workloads import prepare_chat_workload  # noqa: E402


def adopt_orphans() -> None:
    """Make this process the subreaper of its descendants, so the CPU time of a run's processes that
    outlive their parent (the ranks' fork server ends just after the run process) is counted too."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER (Linux)


def reap_orphans(timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)  # an adopted process is still ending
    say(f"adopted processes still running after {timeout:.0f}s; their CPU time is not counted")


def tree_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(cli: str, workload: Path, out: Path, env: dict[str, str], ranks: int, log: Path,
             start_method: str = "") -> dict[str, Any]:
    env = {**env, "DATA_PARALLEL_SIZE": str(ranks), **({"RANK_START_METHOD": start_method} if start_method else {})}
    cpu_before = tree_cpu_seconds()
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.run([cli, "run", str(workload), "--output-dir", str(out)], env=env, cwd=REPO,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=3600)
    wall = time.perf_counter() - started
    reap_orphans()
    if proc.returncode != 0:
        raise SystemExit(f"{ranks} rank(s): exit code {proc.returncode}; see {log}")
    m = json.loads((out / "metrics.json").read_text())
    return {
        "ranks": ranks,
        "start_method": start_method if ranks > 1 else "",
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(tree_cpu_seconds() - cpu_before, 1),
        "model_load_seconds": m["model_load_seconds"],
        "inference_seconds": m["inference_seconds"],
        "output_tokens_per_second": m["output_tokens_per_second"],
        "requests_per_rank": m["requests_per_rank"],
        "peak_memory_mb": m["peak_memory_mb"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="rank counts to compare, comma-separated (default 1,2)")
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCH_PIPELINE_CACHE") or DEFAULT_CACHE))
    p.add_argument("--start-methods", default="",
                   help="RANK_START_METHODs to compare for rank counts above 1, e.g. forkserver,spawn "
                        "(default: the setting's default only)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    methods = [m.strip() for m in args.start_methods.split(",") if m.strip()] or [""]
    variants = [(n, m) for n in counts for m in (methods if n > 1 else [""])]
    adopt_orphans()

    work = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    env, pre, workload, cli = prepare_chat_workload(args, work)
    say(f"{args.num_requests} x {args.output_len} greedy chat requests on {pre['served_model_name']}; "
        f"ranks {counts}; start methods {methods}; {args.rounds} round(s); {os.cpu_count()} CPU(s); logs in {work}")

    runs = []
    for round_ in range(args.rounds):
        for ranks, method in variants:
            tag = f"r{round_}-dp{ranks}" + (f"-{method}" if method else "")
            result = run_once(cli, workload, work / tag, env, ranks, work / f"{tag}.log", method)
            runs.append(result)
            say(f"round {round_ + 1}, {ranks} rank(s){' ' + method if method else ''}: wall {result['wall_seconds']:.1f}s, "
                f"CPU {result['cpu_seconds']:.0f}s, load {result['model_load_seconds']:.1f}s, inference "
                f"{result['inference_seconds']:.1f}s, {result['output_tokens_per_second']:.0f} output tok/s, per rank "
                f"{result['requests_per_rank']}")

    def label(ranks: int, method: str) -> str:
        return f"{ranks} {method}".strip()

    best = {label(n, m): min((r for r in runs if r["ranks"] == n and r["start_method"] == m),
                             key=lambda r: r["wall_seconds"]) for n, m in variants}
    base = best[label(*variants[0])]["wall_seconds"]
    print()
    print(f"{'ranks':>16}  {'best wall s':>11}  {'vs first':>8}  {'CPU s':>6}  {'load s':>6}  {'infer s':>7}  "
          f"{'tok/s':>7}  requests per rank (balance)")
    for name, r in best.items():
        per = r["requests_per_rank"]
        balance = f"{min(per) / max(per):.2f}" if per and max(per) else "-"
        print(f"{name:>16}  {r['wall_seconds']:>11.1f}  {r['wall_seconds'] / base:>7.2f}x  {r['cpu_seconds']:>6.0f}  "
              f"{r['model_load_seconds']:>6.1f}  {r['inference_seconds']:>7.1f}  {r['output_tokens_per_second']:>7.0f}  "
              f"{per} ({balance})")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "best": best, "workload": {"num_requests": args.num_requests, "output_len": args.output_len, "seed": args.seed}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

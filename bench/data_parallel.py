#!/usr/bin/env python3
"""One batch on 1 engine vs DATA_PARALLEL_SIZE ranks: wall time, phases and rank balance, in one run.

A script, not a test. From the repository root:

    .venv/bin/python bench/data_parallel.py                          # 192 x 32 chat, 1 vs 2 ranks, 2 rounds
    .venv/bin/python bench/data_parallel.py --ranks 1,2 --num-requests 384 --output-len 64 --rounds 1

Each round runs `batch-pipeline run` once per rank count, alternating (1, 2, 1, 2, ...) so machine
noise hits them alike; every run is a new process writing into a fresh folder. Printed per run:
wall time (process start to exit), model load, inference phase, output tokens/s and
`requests_per_rank` from metrics.json; then, per rank count, the best wall time and its ratio to
one engine's.

On a machine without GPUs each rank is pinned to its own CPU cores (engine/placement.py), so on a
2-core machine 2 ranks split the same 2 cores one engine had: no speed-up is expected there; the
figures show the cost of the extra process and the balance. On a GPU server each rank has its own
GPU and the inference phase shrinks about linearly (docs/GPU.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CACHE, REPO, say  # noqa: E402
from workloads import prepare_chat_workload  # noqa: E402


def run_once(cli: str, workload: Path, out: Path, env: dict[str, str], ranks: int, log: Path) -> dict[str, Any]:
    env = {**env, "DATA_PARALLEL_SIZE": str(ranks)}
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.run([cli, "run", str(workload), "--output-dir", str(out)], env=env, cwd=REPO,
                              stdout=sink, stderr=subprocess.STDOUT, timeout=3600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{ranks} rank(s): exit code {proc.returncode}; see {log}")
    m = json.loads((out / "metrics.json").read_text())
    return {
        "ranks": ranks,
        "wall_seconds": round(wall, 2),
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
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",") if x.strip()]

    work = Path(tempfile.mkdtemp(prefix="bench-dp-"))
    env, pre, workload, cli = prepare_chat_workload(args, work)
    say(f"{args.num_requests} x {args.output_len} greedy chat requests on {pre['served_model_name']}; "
        f"ranks {counts}; {args.rounds} round(s); {os.cpu_count()} CPU(s); logs in {work}")

    runs = []
    for round_ in range(args.rounds):
        for ranks in counts:
            tag = f"r{round_}-dp{ranks}"
            result = run_once(cli, workload, work / tag, env, ranks, work / f"{tag}.log")
            runs.append(result)
            say(f"round {round_ + 1}, {ranks} rank(s): wall {result['wall_seconds']:.1f}s, load "
                f"{result['model_load_seconds']:.1f}s, inference {result['inference_seconds']:.1f}s, "
                f"{result['output_tokens_per_second']:.0f} output tok/s, per rank {result['requests_per_rank']}")

    best = {n: min((r for r in runs if r["ranks"] == n), key=lambda r: r["wall_seconds"]) for n in counts}
    base = best[counts[0]]["wall_seconds"]
    print()
    print(f"{'ranks':>5}  {'best wall s':>11}  {'vs ' + str(counts[0]):>6}  {'load s':>6}  {'infer s':>7}  "
          f"{'tok/s':>7}  requests per rank (balance)")
    for n in counts:
        r = best[n]
        per = r["requests_per_rank"]
        balance = f"{min(per) / max(per):.2f}" if per and max(per) else "-"
        print(f"{n:>5}  {r['wall_seconds']:>11.1f}  {r['wall_seconds'] / base:>5.2f}x  {r['model_load_seconds']:>6.1f}  "
              f"{r['inference_seconds']:>7.1f}  {r['output_tokens_per_second']:>7.0f}  {per} ({balance})")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "best": best, "workload": {"num_requests": args.num_requests, "output_len": args.output_len, "seed": args.seed}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

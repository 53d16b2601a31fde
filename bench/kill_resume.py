#!/usr/bin/env python3
"""What a `kill -9` costs: answers kept by checkpoints, for several CHECKPOINT_SECONDS, in one run.

A script, not a test. From the repository root:

    .venv/bin/python bench/kill_resume.py                         # 720 x 24, CHECKPOINT_SECONDS 10 then 5
    .venv/bin/python bench/kill_resume.py --num-requests 720 --output-len 24 --seconds 10,5,10,5,10 --kill-at 0.6

For each CHECKPOINT_SECONDS value in the order given (repeat values for more rounds; alternate them
so machine noise hits them alike):
1. a full `batch-pipeline run` of the workload: its inference phase T (metrics.json), the checkpoint
   parts it wrote and the time spent writing them (reported per 10k lines);
2. the same command again into a fresh folder, SIGKILLed (the whole process group) once the model
   has loaded and `--kill-at` x T has passed: a crash 60% into the inference phase;
3. the command once more on that folder: `resumed_requests` in its metrics.json is what the
   checkpoints kept, out of the answers the killed run had produced by then (~ kill-at x requests).

Workload, environment and model are those of bench/run_bench.py (chat questions, greedy, the
pipeline's own engine settings, in-process engine core on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CACHE, REPO, say  # noqa: E402
from workloads import prepare_chat_workload  # noqa: E402

LOADED_MARK = "loaded in"  # "generate model <name> loaded in 12.3s" (engine/local.py)


def run_cli(cmd: list[str], env: dict[str, str], log: Path, kill_after: float | None, timeout: float) -> dict[str, Any]:
    """Run the CLI; with `kill_after`, SIGKILL its process group that many seconds after the model loaded."""
    started = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        loaded = threading.Event()
        killed_at: list[float] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if LOADED_MARK in line and not loaded.is_set():
                    loaded.set()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        if kill_after is not None:
            if not loaded.wait(timeout):
                raise SystemExit(f"the model never loaded; see {log}")
            time.sleep(kill_after)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                killed_at.append(time.perf_counter() - started)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    return {"exit_code": proc.returncode, "wall_s": round(time.perf_counter() - started, 2), "killed": bool(killed_at)}


def answered_lines(parts: Iterable[Path]) -> set[int]:
    """The input lines answered in these checkpoint parts. Split on "\n" only: an answer may hold
    U+2028 and other breaks that str.splitlines would split inside a JSON string."""
    return {json.loads(raw)["line"] for part in parts for raw in part.read_text().split("\n") if raw.strip()}


def answered_in_checkpoints(out: Path) -> int:
    return len(answered_lines(out.glob("_work/answers/*/part-*.jsonl")))


def answered_by(out: Path, after: float) -> int:
    """Answers of a finished run that were on disk `after` seconds into its inference phase (by the
    checkpoint parts' write times): what a run killed then had produced, give or take the 1 s a
    part waits for a pause in the answers. Wave by wave, not kill-at x requests."""
    inference = json.loads((out / "_work" / "inference.json").read_text())
    deadline = inference["inference_started_at"] + after
    return len(answered_lines(p for p in out.glob("_work/answers/*/part-*.jsonl") if p.stat().st_mtime <= deadline))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=720)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--seconds", default="10,5",
                   help="CHECKPOINT_SECONDS values, a round each in this order (default 10,5; repeat values for more rounds)")
    p.add_argument("--kill-at", type=float, default=0.6, help="share of the inference phase before the kill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=Path, help="write the figures to this JSON file")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("BATCH_PIPELINE_CACHE") or DEFAULT_CACHE))
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="batch_pipeline_kill_"))
    env, pre, workload, cli = prepare_chat_workload(args, work)
    values = [float(v) for v in args.seconds.split(",") if v.strip()]
    say(f"{args.num_requests} x {args.output_len} chat requests; CHECKPOINT_SECONDS {values}; kill at {args.kill_at:.0%}")

    results = []
    for round_no, seconds in enumerate(values, 1):
        run_env = dict(env, CHECKPOINT_SECONDS=str(seconds))
        tag = f"r{round_no}-s{seconds:g}"  # a value may be given more than once: each round its own folders
        full = work / f"{tag}-full"
        say(f"CHECKPOINT_SECONDS={seconds:g}: full run ...")
        done = run_cli([cli, "run", str(workload), "--output-dir", str(full)], run_env, work / f"{tag}-full.log", None, args.timeout)
        metrics = json.loads((full / "metrics.json").read_text())
        infer = metrics["inference_seconds"]
        killed_dir = work / f"{tag}-killed"
        say(f"  inference {infer:.1f}s, {metrics['checkpoint_parts']} parts; killing a second run at {args.kill_at * infer:.1f}s ...")
        kill = run_cli([cli, "run", str(workload), "--output-dir", str(killed_dir)], run_env, work / f"{tag}-kill.log",
                       args.kill_at * infer, args.timeout)
        kept = answered_in_checkpoints(killed_dir)
        by_then = answered_by(full, args.kill_at * infer)
        resume = run_cli([cli, "run", str(workload), "--output-dir", str(killed_dir)], run_env, work / f"{tag}-resume.log",
                         None, args.timeout)
        resumed = json.loads((killed_dir / "metrics.json").read_text())["resumed_requests"]
        lines = metrics["requests_total"]
        results.append({
            "checkpoint_seconds": seconds,
            "full_run_exit": done["exit_code"],
            "inference_seconds": infer,
            "killed": kill["killed"],
            "kill_after_model_load_s": round(args.kill_at * infer, 2),
            "answers_in_checkpoints_after_kill": kept,
            "resumed_requests": resumed,
            "full_run_answered_by_then": by_then,
            "reused_share": round(resumed / lines, 4),
            "resume_exit": resume["exit_code"],
            "parts_per_10k_lines": round(metrics["checkpoint_parts"] * 10_000 / lines, 1),
            "checkpoint_write_seconds": metrics["checkpoint_write_seconds"],
            "write_share_of_inference": round(metrics["checkpoint_write_seconds"] / infer, 5) if infer else None,
        })
        say(f"  kept {resumed} of {lines} answers ({resumed / lines:.0%}) after the kill; resume exit {resume['exit_code']}; "
            f"the full run had {by_then} on disk by then")

    print()
    print(f"kill -9 at {args.kill_at:.0%} of the inference phase, {args.num_requests} x {args.output_len} ({pre['engine']})")
    print("| CHECKPOINT_SECONDS | inference s | answers reused | full run's answers by then | parts per 10k lines "
          "| time writing parts |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['checkpoint_seconds']:g} | {r['inference_seconds']:.1f} | {r['resumed_requests']} "
              f"({r['reused_share']:.0%}) | {r['full_run_answered_by_then']} | {r['parts_per_10k_lines']:.0f} "
              f"| {r['checkpoint_write_seconds']:.3f} s "
              f"({(r['write_share_of_inference'] or 0):.2%} of inference) |")
    if args.json:
        args.json.write_text(json.dumps({"work_dir": str(work), "results": results}, indent=2) + "\n")
    shutil.rmtree(work / "tmp", ignore_errors=True)
    return 0 if all(r["killed"] and r["resume_exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

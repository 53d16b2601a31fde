#!/usr/bin/env python3
"""A date of several files asking about the same documents: planned together against one by one.

A script, not a test. From the repository root:

    .venv/bin/python bench/date_files.py                     # 4 files, 16 documents x 8 questions, 2 rounds
    .venv/bin/python bench/date_files.py --files 4 --num-docs 30 --rounds 2 --json /tmp/date-files.json

A date's files often share system prompts and documents (issue #24: "across every file of the
run"). The workload is run_bench.py's documents x questions (a system prompt, one document, one
question, greedy, 16 output tokens), shuffled and dealt out over --files files of one date folder.
Each system runs the whole date as one pipeline run (the four assets of one partition, as the
nightly schedule launches them; Dagster in-process, one model load), each as a fresh process:

    input         ORDER=input: the files one after another, each in file order;
    planned_each  ORDER=planned with the code of --baseline-rev (default 5eafffc, the last commit
                  before plans spanned files): the files one after another, each in its own plan;
    planned       ORDER=planned with the working tree: one plan and one engine stream over every file.

All get the same engine settings (run_bench.py's: MAX_MODEL_LEN 2048, a 256 MiB KV cache, prefix
caching on). Rounds alternate the systems and rotate their order. Printed per run: wall time (spawn
to exit), the inference seconds summed over the files' metrics.json, and the prefix-cache hit rate
(cached prompt tokens / prompt tokens over the files' batch.json); then medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_CACHE, add_engine_options, apply_engine_settings, child_env, export_revision, medians, preflight, rotating_rounds,
    say,
)
from dates import DATE, DATE_RUN_CHILD, add_date_options, date_figures, run_date, write_date  # noqa: E402

SYSTEMS = ("input", "planned_each", "planned")
ORDER = {"input": "input", "planned_each": "planned", "planned": "planned"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_date_options(p)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--baseline-rev", default="5eafffc", help="the code planned_each runs (default 5eafffc)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    add_engine_options(p)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-date-files-"))
    env = child_env(args.cache, work / "tmp")
    apply_engine_settings(args, env)
    say("engine settings: " + ", ".join(f"{k}={env.get(k, '(default)')}" for k in
                                        ("MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES", "ENABLE_PREFIX_CACHING")))
    pre = preflight(args.python, env)
    workload = write_date(args, pre["served_model_name"], pre["model_path"], work / "in")
    say(f"{workload['lines']} lines ({args.num_docs} documents x {args.questions_per_doc} questions, shuffled) "
        f"in {args.files} files of {work / 'in' / DATE}")
    baseline = None
    if "planned_each" in systems:
        commit, baseline = export_revision(args.baseline_rev, work, "--baseline-rev")
        say(f"planned_each runs {args.baseline_rev} = {commit[:12]}, exported to {baseline}")
    (work / "child.py").write_text(DATE_RUN_CHILD)
    runs: list[dict[str, Any]] = []
    for round_no, system in rotating_rounds(systems, args.rounds):
        out = work / f"r{round_no}-{system}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        run_env = dict(env, ORDER=ORDER[system])
        if system == "planned_each":
            run_env["PYTHONPATH"] = os.pathsep.join(x for x in (str(baseline), env.get("PYTHONPATH", "")) if x)
        say(f"round {round_no}/{args.rounds}: {system} ...")
        m = run_date(args.python, work / "child.py", work / "in", out / "out", run_env, out / "log.txt", args.timeout)
        if m["exit_code"] != 0:
            raise SystemExit(f"{system}: exit code {m['exit_code']}; see {m['log']}")
        record = {"round": round_no, "system": system, "wall_s": m["wall_s"], **date_figures(out / "out"),
                  "loadavg_1m_before": m["loadavg_1m_before"]}
        if record["completed"] != workload["lines"]:
            raise SystemExit(f"{system}: {record['completed']} of {workload['lines']} lines completed; see {m['log']}")
        runs.append(record)
        say(f"  {system}: {record['wall_s']:.1f}s wall, inference {record['inference_s']:.1f}s, "
            f"hit rate {record['hit_rate']:.1%}, load avg before {record['loadavg_1m_before']}")
    summary = medians(runs, systems, ("wall_s", "inference_s", "planning_s", "hit_rate"))
    print(f"\n{workload['lines']} lines in {args.files} files, {args.rounds} alternating rounds (medians):")
    print(f"{'system':<14}{'wall s':>9}{'inference s':>13}{'planning s':>12}{'hit rate':>10}{'wall vs planned':>17}")
    reference = summary.get("planned", {}).get("wall_s")
    for system, s in summary.items():
        ratio = f"{s['wall_s'] / reference:.2f}x" if reference else "-"
        print(f"{system:<14}{s['wall_s']:>9.1f}{s['inference_s']:>13.1f}{s['planning_s']:>12.2f}{s['hit_rate']:>10.1%}{ratio:>17}")
    if args.json:
        args.json.write_text(json.dumps({"workload": workload, "runs": runs, "summary": summary,
                                         "baseline_rev": args.baseline_rev}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

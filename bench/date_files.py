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
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CACHE, REPO, child_env, engine_settings_env, measure, preflight, say  # noqa: E402
from workloads import DOC_SYSTEM, doc_questions, document_text, tokenizer  # noqa: E402

DATE = "2026-12-01"
SYSTEMS = ("input", "planned_each", "planned")
ORDER = {"input": "input", "planned_each": "planned", "planned": "planned"}

# What each run executes: the date's four assets in-process, then an immediate exit (as the CLI does).
CHILD = r"""
import os, sys
import dagster as dg
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
inbox, out, date = sys.argv[1:4]
result = dg.materialize(BATCH_ASSETS, partition_key=date, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
                        resources={"batch": BatchSelection(), "llm": LLMResource(),
                                   "storage": StorageResource(input_path=inbox, output_path=out)})
sys.stdout.flush(); sys.stderr.flush()
os._exit(0 if result.success else 1)
"""


def write_date(args: argparse.Namespace, served: str, model_path: str, inbox: Path) -> dict[str, Any]:
    """The documents x questions lines, shuffled, dealt out round-robin over --files files."""
    tok = tokenizer(model_path)
    bodies = []
    for d in range(args.num_docs):
        doc = document_text(tok, random.Random(f"{args.seed}-doc-{d}"), d, args.doc_len)
        for q in doc_questions(random.Random(f"{args.seed}-questions-{d}"), args.questions_per_doc):
            bodies.append({"model": served, "max_tokens": args.output_len, "temperature": 0,
                           "messages": [{"role": "system", "content": DOC_SYSTEM},
                                        {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q}"}]})
    random.Random(args.seed).shuffle(bodies)
    folder = inbox / DATE
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(args.files):
        lines = [json.dumps({"custom_id": f"f{f}-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                 for i, b in enumerate(bodies[f::args.files])]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return {"files": args.files, "lines": len(bodies), "num_docs": args.num_docs,
            "questions_per_doc": args.questions_per_doc, "output_len": args.output_len}


def baseline_source(rev: str, work: Path) -> Path:
    """The batch_pipeline package of `rev`, exported read-only (put first on the child's PYTHONPATH)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True).stdout.strip()
    if not commit:
        raise SystemExit(f"--baseline-rev {rev!r}: not a commit of {REPO}")
    dest = work / f"pipeline-src-{commit[:12]}"
    if not (dest / "batch_pipeline").is_dir():
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "batch_pipeline"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    say(f"planned_each runs {rev} = {commit[:12]}, exported to {dest}")
    return dest


def figures(out: Path) -> dict[str, Any]:
    """Summed over the date's files: lines answered, inference seconds, prompt and cached tokens."""
    folders = sorted(p.parent for p in (out / DATE).glob("*/batch.json"))
    batches = [json.loads((f / "batch.json").read_text()) for f in folders]
    metrics = [json.loads((f / "metrics.json").read_text()) for f in folders]
    prompt = sum(b["usage"]["input_tokens"] for b in batches)
    cached = sum(b["usage"]["input_tokens_details"]["cached_tokens"] for b in batches)
    return {
        "files": len(folders),
        "completed": sum(b["request_counts"]["completed"] for b in batches),
        "inference_s": round(sum(m["inference_seconds"] for m in metrics), 2),
        "model_load_s": round(sum(m["model_load_seconds"] for m in metrics), 2),
        "planning_s": round(sum(m.get("planning_seconds", 0.0) for m in metrics), 2),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--num-docs", type=int, default=16)
    p.add_argument("--questions-per-doc", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=400, help="document length in tokens (default 400)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--baseline-rev", default="5eafffc", help="the code planned_each runs (default 5eafffc)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    for name in ("max_model_len", "kv_cache_mib", "prefix_caching"):
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-date-files-"))
    env = child_env(args.cache, work / "tmp")
    for name, value in engine_settings_env(args, env).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    say("engine settings: " + ", ".join(f"{k}={env.get(k, '(default)')}" for k in
                                        ("MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES", "ENABLE_PREFIX_CACHING")))
    pre = preflight(args.python, env)
    workload = write_date(args, pre["served_model_name"], pre["model_path"], work / "in")
    say(f"{workload['lines']} lines ({args.num_docs} documents x {args.questions_per_doc} questions, shuffled) "
        f"in {args.files} files of {work / 'in' / DATE}")
    baseline = baseline_source(args.baseline_rev, work) if "planned_each" in systems else None
    (work / "child.py").write_text(CHILD)
    runs: list[dict[str, Any]] = []
    order = list(systems)
    for round_no in range(1, args.rounds + 1):
        if round_no > 1:
            order = order[1:] + order[:1]
        for system in order:
            out = work / f"r{round_no}-{system}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            run_env = dict(env, ORDER=ORDER[system])
            if system == "planned_each":
                run_env["PYTHONPATH"] = os.pathsep.join(x for x in (str(baseline), env.get("PYTHONPATH", "")) if x)
            say(f"round {round_no}/{args.rounds}: {system} ...")
            m = measure([args.python, str(work / "child.py"), str(work / "in"), str(out / "out"), DATE],
                        run_env, out / "log.txt", args.timeout)
            if m["exit_code"] != 0:
                raise SystemExit(f"{system}: exit code {m['exit_code']}; see {m['log']}")
            record = {"round": round_no, "system": system, "wall_s": m["wall_s"], **figures(out / "out"),
                      "loadavg_1m_before": m["loadavg_1m_before"]}
            if record["completed"] != workload["lines"]:
                raise SystemExit(f"{system}: {record['completed']} of {workload['lines']} lines completed; see {m['log']}")
            runs.append(record)
            say(f"  {system}: {record['wall_s']:.1f}s wall, inference {record['inference_s']:.1f}s, "
                f"hit rate {record['hit_rate']:.1%}, load avg before {record['loadavg_1m_before']}")
    summary = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        summary[system] = {key: round(statistics.median(r[key] for r in mine), 2)
                           for key in ("wall_s", "inference_s", "planning_s", "hit_rate")}
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

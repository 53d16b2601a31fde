"""A date of several files asking about the same documents (date_files.py, date_files_runs.py): the
workload (workloads.py's documents x questions, shuffled and dealt out over the files of one date
folder), the date as one run in a fresh process, and the figures summed over the date's files.

Not a benchmark: date_files.py and date_files_runs.py import it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common import measure
from workloads import CHAT_URL, docs_question_bodies, tokenizer


DATE = "2026-12-01"


def add_date_options(p: argparse.ArgumentParser) -> None:
    """The date's workload (--files, --num-docs, --questions-per-doc, --doc-len, --output-len, --seed) and --rounds."""
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--num-docs", type=int, default=16)
    p.add_argument("--questions-per-doc", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=400, help="document length in tokens (default 400)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)


def write_date(args: argparse.Namespace, served: str, model_path: str, inbox: Path) -> dict[str, Any]:
    """The documents x questions lines, shuffled, dealt out round-robin over --files files of <inbox>/DATE."""
    tok = tokenizer(model_path)
    bodies = docs_question_bodies(tok, served, args.seed, args.num_docs, args.questions_per_doc, args.doc_len,
                                  args.output_len)
    folder = inbox / DATE
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(args.files):
        lines = [json.dumps({"custom_id": f"f{f}-{i:05d}", "method": "POST", "url": CHAT_URL, "body": b})
                 for i, b in enumerate(bodies[f::args.files])]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return {"files": args.files, "lines": len(bodies), "num_docs": args.num_docs,
            "questions_per_doc": args.questions_per_doc, "output_len": args.output_len}


def date_figures(out: Path) -> dict[str, Any]:
    """Summed over the date's files under `out`: lines answered, inference seconds, prompt and cached tokens."""
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


# The date as one run: the date's four batch assets in-process on an ephemeral instance, then an immediate
# exit (as the CLI does). argv: inbox, output folder, date.
DATE_RUN_CHILD = r"""
import os, sys
import dagster as dg
import batch_pipeline
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
print("batch_pipeline from", os.path.dirname(batch_pipeline.__file__), flush=True)
inbox, out, date = sys.argv[1:4]
result = dg.materialize(BATCH_ASSETS, partition_key=date, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
                        resources={"batch": BatchSelection(), "llm": LLMResource(),
                                   "storage": StorageResource(input_path=inbox, output_path=out)})
sys.stdout.flush(); sys.stderr.flush()
os._exit(0 if result.success else 1)
"""


def run_date(python: str, child: Path, inbox: Path, out: Path, env: dict[str, str], log: Path,
             timeout: float) -> dict[str, Any]:
    """The date as one run: `child` (DATE_RUN_CHILD written to a file) in a fresh process, timed by
    common.measure from spawn to exit."""
    return measure([python, str(child), str(inbox), str(out), DATE], env, log, timeout)

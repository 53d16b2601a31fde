#!/usr/bin/env python3
"""Engine steps to answer a batch in file order and in the pipeline's planned order: a figure the
machine's load cannot move.

A script, not a test. From the repository root, on an OpenAI Batch file of chat lines (e.g. the
mixed-lengths workload `bench/run_bench.py --keep` writes):

    BATCH_SIZE=16 .venv/bin/python bench/order_steps.py /tmp/workload-mixed-lengths.jsonl
    BATCH_SIZE=16 .venv/bin/python bench/order_steps.py FILE --rounds 2 --json /tmp/order-steps.json

Why: wall times of whole runs on these shared 2-core machines swing 2x with what else runs (a
mixed-lengths round of the same system took 74 s and 219 s on one morning). The number of engine
steps the batch takes does not: greedy lines with `ignore_eos` decode exactly `max_tokens` each, and
vLLM's scheduler admits waiting requests first come first served up to `max_num_seqs`
(`BATCH_SIZE`), so the steps depend only on the order the lines are fed. On a GPU, where a decode
step costs about the same whatever its batch (bound by reading the weights; bench/decode_steps.py
shows how far these CPUs are from that), steps are time; here they are a floor under it.

For each order, the same engine (the pipeline's engine arguments for the bundled model, as
`batch-pipeline run` resolves them, built once in this process) is given every line at once with
`LLM.enqueue_chat`, the way the pipeline feeds it, and stepped until done. The planned order is the
pipeline's own (`steps/ordering.py`'s plan over the file, with the model's chat template): long
expected decodes first, shared prefixes together. Printed per order: engine steps, mean sequences
per step (generated tokens / steps), and the wall time of this round (labelled: it moves with load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import build_llm, finish, say  # noqa: E402  the same engine as bench/decode_steps.py


def planned(lines: list[dict[str, Any]], model_path: str) -> tuple[list[dict[str, Any]], float]:
    """The lines in the order the pipeline's planner feeds them, and the seconds planning took."""
    from batch_pipeline.steps.ordering import chat_template_renderer, make_plan

    started = time.perf_counter()
    render, _ = chat_template_renderer(model_path)
    records = [(i, json.dumps({"request": line}).encode() + b"\n") for i, line in enumerate(lines)]
    plan = make_plan(records, len(records), None, render)
    try:
        ordered = [json.loads(raw)["request"] for raw in plan.records()]
    finally:
        plan.close()
    return ordered, time.perf_counter() - started


def run(llm: Any, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Every line enqueued at once, then the engine stepped until it holds nothing."""
    from vllm import SamplingParams

    from batch_pipeline.engine import vllm_adapter

    messages = [line["body"]["messages"] for line in lines]
    params = [SamplingParams(temperature=0.0, max_tokens=line["body"]["max_tokens"],
                             ignore_eos=bool(line["body"].get("ignore_eos"))) for line in lines]
    started = time.perf_counter()
    llm.enqueue_chat(messages, params, use_tqdm=False)
    steps = tokens = done = 0
    while vllm_adapter.has_unfinished(llm):
        outputs = vllm_adapter.step(llm)
        steps += 1
        done += len(outputs)
        tokens += sum(len(c.token_ids) for out in outputs for c in out.outputs)
    assert done == len(lines), (done, len(lines))
    return {"steps": steps, "tokens": tokens, "seconds": round(time.perf_counter() - started, 2),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path, help="an OpenAI Batch JSONL file of /v1/chat/completions lines")
    p.add_argument("--rounds", type=int, default=1, help="rounds; the orders alternate within each (default 1)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    lines = [json.loads(raw) for raw in args.file.read_text().splitlines() if raw.strip()]
    if any(line.get("url") != "/v1/chat/completions" or "max_tokens" not in line.get("body", {}) for line in lines):
        raise SystemExit(f"{args.file}: every line must be a /v1/chat/completions line with body.max_tokens")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step() in this process, as the pipeline's default
    say(f"{len(lines)} lines, max_tokens {min(x['body']['max_tokens'] for x in lines)}-"
        f"{max(x['body']['max_tokens'] for x in lines)}; load average before: {os.getloadavg()[0]:.2f}")
    llm = build_llm()
    model_path = llm.llm_engine.model_config.model
    orders = {"file order": lines}
    orders["planned"], plan_seconds = planned(lines, model_path)
    say(f"planned in {plan_seconds:.2f} s")
    run(llm, lines[:2])  # warm-up, untimed
    runs: list[dict[str, Any]] = []
    names = list(orders)
    for r in range(args.rounds):
        for name in names[r % 2:] + names[:r % 2]:
            result = {"order": name, "round": r, **run(llm, orders[name])}
            runs.append(result)
            say(f"round {r + 1}/{args.rounds}: {name}: {result['steps']} steps, {result['seconds']} s, "
                f"load {result['loadavg_1m']}")
    print(f"\n{len(lines)} lines, BATCH_SIZE (max_num_seqs) {os.environ.get('BATCH_SIZE', 'default')}, "
          f"{args.rounds} round(s):")
    print(f"{'order':<12} {'engine steps':>12} {'seqs/step':>10} {'wall s (median, load-bound)':>28}")
    summary = {}
    for name in names:
        mine = [x for x in runs if x["order"] == name]
        steps = mine[0]["steps"]
        assert all(x["steps"] == steps for x in mine), f"{name}: steps differ between rounds: {mine}"
        summary[name] = {"steps": steps, "seqs_per_step": round(mine[0]["tokens"] / steps, 2),
                         "seconds_median": statistics.median(x["seconds"] for x in mine)}
        print(f"{name:<12} {steps:>12} {summary[name]['seqs_per_step']:>10.2f} {summary[name]['seconds_median']:>28.1f}")
    ratio = summary["file order"]["steps"] / summary["planned"]["steps"]
    print(f"planned takes {ratio:.3f}x fewer engine steps than file order (deterministic); "
          f"wall time this run {summary['file order']['seconds_median'] / summary['planned']['seconds_median']:.2f}x")
    finish(args.json, {"runs": runs, "summary": summary, "plan_seconds": plan_seconds})


if __name__ == "__main__":
    main()

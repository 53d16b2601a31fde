#!/usr/bin/env python3
"""What a decode step costs as the batch grows: why "long decodes first" pays on a GPU and not here.

A script, not a test. From the repository root:

    .venv/bin/python bench/decode_steps.py                       # batches 1, 4, 16, 64; 3 rounds
    .venv/bin/python bench/decode_steps.py --batches 1,8,32,96 --steps 48 --json /tmp/decode-steps.json

"Long decodes first" (ORDER=planned) shortens a batch's tail: the last few long generations decode
alone, a step each, while the engine could have run many sequences in the same step. That pays
when a step costs about the same whatever the batch (decode on a GPU is bound by reading the
weights, so a step of 64 sequences costs little more than a step of 1). Where a step costs in
proportion to the sequences in it, as on a compute-bound CPU, the tail costs what the same tokens
would cost anywhere else, and no order can shorten the total.

This measures it on the engine the pipeline builds (the pipeline's engine arguments for the bundled
model, `LLMResource` as `batch-pipeline run` resolves it, in this one process): for each batch size
B, B short prompts (`ignore_eos`, `--steps` tokens each) are enqueued together and the engine is
stepped until they finish; the first steps (prefill) are left out, and the decode steps are timed.
Batch sizes alternate within each round and the order rotates between rounds. Printed per size:
median ms per decode step, ms per generated token, tokens/s, and the step's cost relative to a
batch of 1 (1.00x flat would be a GPU's shape; B x would be fully proportional).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from common import build_llm, finish, say  # noqa: E402


def one(llm: Any, batch: int, steps: int, round_: int) -> dict[str, Any]:
    """B prompts decoded together: the decode steps' times (the prefill steps left out)."""
    from vllm import SamplingParams

    from batch_pipeline.engine import vllm_adapter

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    # Distinct prompts (a round and an index in each) so nothing comes from the prefix cache.
    prompts = [f"Round {round_}, item {i}: write a long story about the number {i * 7919 + round_}." for i in range(batch)]
    assert len(llm.enqueue(prompts, params, use_tqdm=False)) == batch
    times: list[float] = []
    first = True
    done = 0
    while vllm_adapter.has_unfinished(llm):
        started = time.perf_counter()
        outputs = vllm_adapter.step(llm)
        seconds = time.perf_counter() - started
        # The first step prefills every prompt (B short prompts fit one step's token budget); each
        # later step adds one token to each of the B sequences (equal lengths: all run to the end).
        # step() returns only finished requests (the LLM class's FINAL_ONLY outputs).
        if not first:
            times.append(seconds)
        first = False
        done += len(outputs)
    assert done == batch, (done, batch)
    return {"batch": batch, "decode_steps": len(times), "step_ms": statistics.median(times) * 1000 if times else None,
            "round": round_}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16,64", help="batch sizes, comma-separated (default 1,4,16,64)")
    p.add_argument("--steps", type=int, default=32, help="tokens each sequence decodes (default 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step() in this process, as the pipeline's default
    say(f"load average before: {os.getloadavg()[0]:.2f}")
    llm = build_llm()
    one(llm, 2, 4, -1)  # warm-up, untimed
    runs = []
    for r in range(args.rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        for b in order:
            run = one(llm, b, args.steps, r)
            run["loadavg_1m"] = round(os.getloadavg()[0], 2)
            runs.append(run)
            say(f"round {r + 1}/{args.rounds}: batch {b}: {run['step_ms']:.1f} ms a decode step "
                f"({run['decode_steps']} steps), load {run['loadavg_1m']}")
    rows = []
    for b in sizes:
        ms = statistics.median(x["step_ms"] for x in runs if x["batch"] == b and x["step_ms"] is not None)
        rows.append({"batch": b, "step_ms": round(ms, 2), "ms_per_token": round(ms / b, 3),
                     "tokens_per_s": round(b * 1000 / ms, 1)})
    base = rows[0]["step_ms"]
    print(f"\ndecode steps of the pipeline's engine, {args.steps} tokens a sequence, medians of {args.rounds} rounds:")
    print(f"{'batch':>6} {'ms/step':>9} {'ms/token':>9} {'tokens/s':>9} {'step vs batch ' + str(sizes[0]):>18}")
    for row in rows:
        row["step_vs_first"] = round(row["step_ms"] / base, 2)
        print(f"{row['batch']:>6} {row['step_ms']:>9.2f} {row['ms_per_token']:>9.3f} {row['tokens_per_s']:>9.1f} "
              f"{row['step_vs_first']:>17.2f}x")
    finish(args.json, {"runs": runs, "summary": rows, "steps": args.steps})


if __name__ == "__main__":
    main()

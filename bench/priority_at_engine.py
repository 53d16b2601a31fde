#!/usr/bin/env python3
"""An urgent batch's requests at the warm engine itself, alone and while bulk requests are in flight: how
much vLLM's priority scheduling protects them, by how many bulk requests are at the server.

A script, not a test. From the repository root:

    .venv/bin/python bench/priority_at_engine.py                        # widths 2, 8, 64; three rounds (~4 min)
    .venv/bin/python bench/priority_at_engine.py --engine-cores 1       # the engine computing on a core of its own
    .venv/bin/python bench/priority_at_engine.py --widths 2,64 --rounds 5 --json /tmp/pae.json

No Dagster, no pipeline run: one vLLM OpenAI-compatible server (the command `batch-pipeline engine start`
runs, the bundled SmolLM2-135M-Instruct, the pipeline's default CPU engine settings, started untimed) and
this script's threads. Per round, in this order: the urgent requests alone; then for each --widths W, W
threads keep one bulk request each in flight (--bulk-tokens 32 tokens, `ignore_eos`, priority 1000,
sent again as each is answered), and after --settle (3) s the urgent requests go: --urgent (8) chat
requests of --urgent-tokens (16) tokens (`ignore_eos`, priority -100: vLLM runs lower numbers sooner),
all at once. Timed: from sending the first urgent request to the last answer. Printed: each round's
times, then per width the median and its ratio to the median alone.

What it tells about the pipeline (docs/PERFORMANCE.md, "The engine computing on a core of its own"): a
run that an urgent run outranks keeps YIELD_WINDOW (2) requests in flight (engine/remote.py), so width 2
is what an urgent batch meets once the bulk has given way, and the pipeline's default window (64) what it
would meet if the bulk did not give way.

--engine-cores N binds the engine's compute threads (VLLM_CPU_OMP_THREADS_BIND) to the last N usable
cores and runs the server's API process and scheduler and this script on the others (the CPU equivalent
of a GPU host); default 0: all share every core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "bench"))
for _name in ("ENGINE_URL", "ENGINE_API_KEY", "MODELS_FILE", "MAX_MODEL_LEN", "KV_CACHE_MEMORY_BYTES",
              "ENABLE_PREFIX_CACHING", "ENGINE_ARGS", "BATCH_SIZE", "MODEL_PATH", "SERVED_MODEL_NAME"):
    os.environ.pop(_name, None)  # the pipeline's defaults for the server, as api_burst.py gives it
os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))

from common import loadavg, say  # noqa: E402
from warm_server import WarmServer, add_engine_cores, apart_engine_env, engine_cores_error  # noqa: E402

URGENT_PRIORITY, BULK_PRIORITY = -100, 1000


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--widths", default="2,8,64", help="bulk requests kept in flight, comma-separated (default 2,8,64)")
    p.add_argument("--urgent", type=int, default=8, help="urgent requests, sent at once (default 8)")
    p.add_argument("--urgent-tokens", type=int, default=16)
    p.add_argument("--bulk-tokens", type=int, default=32)
    p.add_argument("--settle", type=float, default=3.0, help="seconds of bulk load before the urgent requests go")
    add_engine_cores(p)
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args()
    try:
        args.widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
        p.error(f"--widths {args.widths!r}: comma-separated whole numbers, e.g. 2,8,64")
    if not args.widths or min(args.widths) < 1:
        p.error("--widths: at least one width, each at least 1")
    placement = engine_cores_error(args.engine_cores)
    if placement:
        p.error(placement)
    return args


def start_server(args: argparse.Namespace, work: Path) -> tuple[WarmServer, str]:
    from batch_pipeline.config import models

    model_dir = models.prepare_bundled_model(log=say)
    env = apart_engine_env(args.engine_cores)
    server = WarmServer.engine_start(model_dir, model_dir.name, work / "warm-engine.log", env=env).start()
    return server, model_dir.name


class Load:
    """`width` threads, each keeping one bulk request in flight until stopped."""

    def __init__(self, server: WarmServer, served: str, width: int, tokens: int) -> None:
        self.server, self.served, self.tokens = server, served, tokens
        self.stop = threading.Event()
        self.answered = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._keep, args=(k,), daemon=True) for k in range(width)]

    def _keep(self, k: int) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                chat(self.server, self.served, f"bulk {k} {n}", self.tokens, BULK_PRIORITY)
                self.answered += 1
            except Exception as e:  # noqa: BLE001 - reported after the round; the load goes on
                self.errors.append(repr(e))
            n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=600)


def chat(server: WarmServer, served: str, tag: str, tokens: int, priority: int) -> dict[str, Any]:
    answer = server.chat({"model": served, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                          "priority": priority,
                          "messages": [{"role": "user", "content": f"Summarise in one sentence: {tag}, about the sea"}]})
    if answer["usage"]["completion_tokens"] != tokens:
        raise SystemExit(f"{tag}: {answer['usage']['completion_tokens']} tokens instead of {tokens}")
    return answer


def urgent(server: WarmServer, served: str, args: argparse.Namespace, tag: str) -> float:
    failures: list[str] = []

    def one(i: int) -> None:
        try:
            chat(server, served, f"urgent {tag} {i}", args.urgent_tokens, URGENT_PRIORITY)
        except Exception as e:  # noqa: BLE001 - the round fails below, naming it
            failures.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.urgent)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"urgent requests failed: {failures[:3]}")
    return time.perf_counter() - started


def main() -> int:
    import tempfile

    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-priority-at-engine-"))
    say(f"work folder {work}; load average {loadavg()}")
    server, served = start_server(args, work)
    times: dict[str, list[float]] = {"alone": [], **{f"bulk {w}": [] for w in args.widths}}
    try:
        for r in range(1, args.rounds + 1):
            times["alone"].append(urgent(server, served, args, f"r{r} alone"))
            for width in args.widths:
                with Load(server, served, width, args.bulk_tokens) as load:
                    time.sleep(args.settle)
                    times[f"bulk {width}"].append(urgent(server, served, args, f"r{r} w{width}"))
                if load.errors:
                    raise SystemExit(f"bulk requests failed: {load.errors[:3]}")
            say(f"round {r}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
                + f" (load {loadavg()})")
    finally:
        server.stop()
    alone = statistics.median(times["alone"])
    print(f"\n{args.urgent} urgent requests of {args.urgent_tokens} tokens (priority {URGENT_PRIORITY}), bulk requests of "
          f"{args.bulk_tokens} tokens (priority {BULK_PRIORITY}) in flight; engine cores: "
          f"{args.engine_cores or 'shared'}; {args.rounds} rounds")
    print(f"{'bulk in flight':<16}{'median s':>10}{'x alone':>9}  rounds")
    summary = {}
    for key, values in times.items():
        ratio = statistics.median(values) / alone
        summary[key] = {"median_s": round(statistics.median(values), 2), "ratio": round(ratio, 2),
                        "rounds_s": [round(v, 2) for v in values]}
        print(f"{key.replace('bulk ', ''):<16}{statistics.median(values):>10.2f}{ratio:>8.2f}x  "
              + ", ".join(f"{v:.2f}" for v in values))
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                         "warm_engine": {"start_to_healthy_s": server.start_s, "command": server.command},
                                         "urgent": summary}, indent=2))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

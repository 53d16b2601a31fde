#!/usr/bin/env python3
"""What validation costs: `json.loads` of every line against the pipeline's validator, in this process.

A script, not a test. From the repository root:

    .venv/bin/python bench/validate.py --lines 100000 --json /tmp/bench-validate.json

Generates a file of --lines (100 000, about 24 MiB) greedy chat requests (workloads.py's chat questions,
as in run_bench.py's chat workload) and times, in this process, --rounds (3) alternating rounds of:

    json.loads           read the file and json.loads every line: the floor;
    validate_stream      the pipeline's validator (batch_pipeline.steps.validation.validate_stream) with
                         callbacks that discard the results;
    validate+write       the same, writing every valid request to a file, as validate_batch does with
                         _work/requests.jsonl;
    reparse (inference)  that file read back the way infer_batch and GenerationEngine.prepare do: json.loads,
                         BatchRequest.model_validate, then parsed_body().

Prints seconds, lines/s, us per line and each variant's ratio to json.loads. --pipeline-rev REV imports the
validator from that git revision (exported read-only) instead of the working tree.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pipeline_source, say, write_json  # noqa: E402
from workloads import chat_question  # noqa: E402


@dataclass
class _Variants:
    """The four variants timed, over one generated file: each returns the lines it read."""

    path: Path  # the generated requests
    requests_file: Path  # what validate+write writes and reparse (inference) reads back
    settings: Any  # the validator's ValidationSettings
    validate_stream: Callable[..., Any]
    # What validate_batch writes per valid request and how infer_batch reads it back differs between
    # versions of the code: a BatchRequest dumped as JSON, or a ValidLine's own record() bytes.
    to_request: Callable[[Any], Any]

    def all(self) -> list[tuple[str, Callable[[], int]]]:
        return [
            ("json.loads", self.json_loads),
            ("validate_stream", self.validator),
            ("validate+write", self.validator_and_write),
            ("reparse (inference)", self.reparse_for_inference),
        ]

    def json_loads(self) -> int:
        n = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.strip():
                    json.loads(raw)
                    n += 1
        return n

    def validator(self) -> int:
        with open(self.path, "rb") as f:
            summary = self.validate_stream(f, self.settings, _discard, _discard)
        assert summary.invalid == 0, summary.errors_by_code
        return summary.valid

    def validator_and_write(self) -> int:
        # what validate_batch does: every valid request re-serialized to _work/requests.jsonl
        with open(self.path, "rb") as f, open(self.requests_file, "wb") as out:

            def on_valid(req: Any) -> None:
                out.write(_record_bytes(req))

            summary = self.validate_stream(f, self.settings, on_valid, _discard)
        return summary.valid

    def reparse_for_inference(self) -> int:
        # what infer_batch + GenerationEngine.prepare do before the engine sees a request:
        # json.loads, BatchRequest.model_validate, then parsed_body() (the body model again).
        n = 0
        with open(self.requests_file, "rb") as f:
            for raw in f:
                if raw.strip():
                    req = self.to_request(json.loads(raw))
                    req.parsed_body()
                    n += 1
        return n


def _discard(_x: Any) -> None:
    return None


def _record_bytes(req: Any) -> bytes:
    if hasattr(req, "record"):
        return req.record()
    return (json.dumps(req.model_dump(), ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _write_lines(args: argparse.Namespace, path: Path, chat_url: str) -> int:
    """Write --lines greedy chat requests to `path`; return its size in bytes."""
    rng = random.Random(args.seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(args.lines):
            body = {
                "model": args.served_model_name,
                "messages": [{"role": "user", "content": chat_question(rng)}],
                "max_tokens": args.output_len,
                "temperature": 0,
            }
            f.write(json.dumps({"custom_id": f"req-{i:07d}", "method": "POST", "url": chat_url, "body": body}) + "\n")
    size = path.stat().st_size
    say(f"validation: {args.lines} lines, {size / 2**20:.1f} MiB -> {path}")
    return size


def _time_rounds(args: argparse.Namespace, variants: _Variants) -> dict[str, list[float]]:
    """--rounds alternating rounds of the four variants: {variant: seconds of each round}."""
    times: dict[str, list[float]] = {name: [] for name, _ in variants.all()}
    for round_no in range(1, args.rounds + 1):
        for name, fn in variants.all():
            t0 = time.perf_counter()
            n = fn()
            elapsed = time.perf_counter() - t0
            assert n == args.lines, (name, n)
            times[name].append(round(elapsed, 4))
            say(f"round {round_no}/{args.rounds}: {name} {elapsed:.2f}s")
    return times


def _summarize(times: dict[str, list[float]], lines: int) -> dict[str, dict[str, Any]]:
    """Each variant's median, minimum, rate and ratio to json.loads."""
    base = statistics.median(times["json.loads"])
    return {
        name: {
            "s_median": round(statistics.median(v), 4),
            "s_min": min(v),
            "s_all": v,
            "lines_per_s": round(lines / statistics.median(v)),
            "us_per_line": round(1e6 * statistics.median(v) / lines, 2),
            "ratio_to_json_loads": round(statistics.median(v) / base, 2),
        }
        for name, v in times.items()
    }


def validate_bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="batch_pipeline_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    source = pipeline_source(args.pipeline_rev, work, {})
    if "path" in source:
        sys.path.insert(0, source["path"])  # before batch_pipeline is first imported
    from batch_pipeline import contract
    from batch_pipeline.steps import validation
    from batch_pipeline.steps.validation import ValidationSettings, validate_stream

    say(f"validator from {Path(validation.__file__).parent.parent}")
    path = work / "validate.jsonl"
    size = _write_lines(args, path, contract.CHAT_URL)
    variants = _Variants(
        path=path,
        requests_file=work / "requests.jsonl",
        settings=ValidationSettings(served_model_name=args.served_model_name),
        validate_stream=validate_stream,
        to_request=getattr(validation, "request_from_record", None) or contract.BatchRequest.model_validate,
    )
    summary = _summarize(_time_rounds(args, variants), args.lines)
    if not args.keep:
        variants.requests_file.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
    return {
        "meta": {
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "mode": "validate",
            "pipeline_source": source,
            "validator_module": validation.__file__,
            "lines": args.lines,
            "bytes": size,
            "rounds": args.rounds,
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "summary": summary,
    }


def print_validate_table(result: dict[str, Any]) -> None:
    meta, s = result["meta"], result["summary"]
    print()
    print(f"validation: {meta['lines']} lines ({meta['bytes'] / 2**20:.1f} MiB), {meta['rounds']} alternating rounds, in-process")
    header = f"{'variant':<20} {'s median':>9} {'s min':>8} {'lines/s':>9} {'us/line':>8} {'vs json.loads':>13}"
    print(header)
    print("-" * len(header))
    for name, r in s.items():
        print(
            f"{name:<20} {r['s_median']:>9.2f} {r['s_min']:>8.2f} {r['lines_per_s']:>9} {r['us_per_line']:>8.1f} "
            f"{r['ratio_to_json_loads']:>12.2f}x"
        )
    print(f"validator / json.loads: {s['validate_stream']['ratio_to_json_loads']:.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", "--validate-lines", dest="lines", type=int, default=100_000,
                   help="lines of the generated file (default 100000)")
    p.add_argument("--rounds", "--validate-rounds", dest="rounds", type=int, default=3,
                   help="alternating rounds of the four variants (default 3)")
    p.add_argument("--output-len", "--max-tokens", dest="output_len", type=int, default=32,
                   help="max_tokens of every line (default 32)")
    p.add_argument("--seed", type=int, default=0, help="the chat questions' seed")
    p.add_argument("--served-model-name", default="SmolLM2-135M-Instruct", help="body.model of every line")
    p.add_argument("--pipeline-rev", help="import the validator from this git revision (e.g. HEAD), exported read-only")
    p.add_argument("--work-dir", help="where the files go (default: a new folder under $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--json", type=Path, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.lines < 1 or args.rounds < 1:
        p.error("--lines and --rounds must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = validate_bench(args)
    print_validate_table(result)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

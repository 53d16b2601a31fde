"""What validation's image checks cost: chat lines with a data: URL image each, validated in-process
with and without io/images.check_line (the count, the scheme, the host, a data: URL's media type,
base64 and size; no image is fetched or decoded), alternating, medians of the rounds.

Each line carries one random-pixel PNG as a data: URL (incompressible: about 3 bytes a pixel) and
one s3:// url (checked for its form only). The difference between the two timings is what the
checks add to `batch-pipeline validate` and to a run's validation step.

    .venv/bin/python bench/validate_images.py                       # 300 lines of a 200x200 PNG, 3 rounds
    .venv/bin/python bench/validate_images.py --lines 100 --side 1000 --rounds 5 --json /tmp/v.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

import numpy as np
from PIL import Image

from batch_pipeline.steps import validation
from batch_pipeline.steps.validation import ValidationSettings, validate_stream


def batch(lines: int, side: int) -> tuple[bytes, int]:
    """The batch file's bytes and the PNG's size."""
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rows = []
    for i in range(lines):
        parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}},
                 {"type": "image_url", "image_url": {"url": f"s3://bucket/img-{i}.png"}}]
        body = {"model": "vlm", "messages": [{"role": "user", "content": parts}], "max_tokens": 16}
        rows.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return ("\n".join(rows) + "\n").encode(), len(buf.getvalue())


def validate(data: bytes, lines: int) -> float:
    settings = ValidationSettings("vlm", image_models=("vlm",))
    started = time.perf_counter()
    summary = validate_stream(io.BytesIO(data), settings, lambda _v: None, lambda _i: None)
    took = time.perf_counter() - started
    assert summary.valid == lines, summary.errors_by_code
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=300)
    parser.add_argument("--side", type=int, default=200, help="the PNG's width and height in pixels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args()
    data, png_bytes = batch(args.lines, args.side)
    checks = validation.LineValidator._bad_image
    times: dict[str, list[float]] = {"with the image checks": [], "without": []}
    for _ in range(args.rounds):
        for name in times:
            validation.LineValidator._bad_image = checks if name != "without" else (lambda self, url, body: None)
            times[name].append(validate(data, args.lines))
    validation.LineValidator._bad_image = checks
    mib = len(data) / 2**20
    print(f"{args.lines} lines, {mib:.1f} MiB: a {args.side}x{args.side} PNG of {png_bytes} bytes as a data: URL "
          f"and an s3:// url each; medians of {args.rounds} alternating rounds")
    figures = {"lines": args.lines, "mib": round(mib, 2), "png_bytes": png_bytes, "rounds": args.rounds}
    for name, taken in times.items():
        median = statistics.median(taken)
        print(f"  {name:22s} {median:7.3f} s  {1000 * median / args.lines:6.2f} ms/line  {mib / median:6.0f} MiB/s  "
              f"(rounds: {', '.join(f'{t:.3f}' for t in taken)})")
        figures[name] = {"median_seconds": round(median, 4), "rounds": [round(t, 4) for t in taken]}
    added = statistics.median(times["with the image checks"]) - statistics.median(times["without"])
    print(f"  the checks add {1000 * added / args.lines:.2f} ms a line ({added / max(mib, 1e-9) * 1000:.1f} ms a MiB)")
    figures["added_ms_per_line"] = round(1000 * added / args.lines, 3)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Images through the pipeline: images/s, and how much of the answering the engine waited on them.

A script, not a test. From the repository root:

    .venv/bin/python bench/images.py                                   # 240 lines, 1 image each, concurrency 8
    .venv/bin/python bench/images.py --lines 480 --images 2 --concurrency 1,8 --rounds 2 --json /tmp/images.json

Each line of the batch asks the tiny random Idefics3 (batch_pipeline_tests/support/tiny_vlm.py, the test
suite's vision-language model) about `--images` JPEGs (320x240, drawn here, all different) on the
repo's S3 test server (moto's, over HTTP, seeded before it serves), with `--max-tokens` output
tokens each (ignore_eos). Each run is `batch-pipeline run` in its own process with
IMAGE_FETCH_CONCURRENCY set; runs alternate the concurrency values within each round. Printed per
run, from its _work/inference.json: the images answered, the answering time (after the model
load), images/s over it, and the share of it the engine waited on image preparation with nothing
else to step (`image_wait_share`; the issue's target is under 5% with images on the S3 test
server), beside its whole idle share (`engine_idle_share`: also rendering, tokenizing and vLLM's
own image processing, which run in this process between steps).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VLM = "tiny-idefics3"


def say(message: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def jpeg(n: int) -> bytes:
    from PIL import Image

    image = Image.new("RGB", (320, 240))
    image.putdata([((x * 3 + n * 37) % 256, (y * 5 + n * 11) % 256, (x * y + n) % 256) for y in range(240) for x in range(320)])
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def batch_lines(count: int, images: int, max_tokens: int, bucket: str) -> list[str]:
    lines = []
    for i in range(count):
        parts = [{"type": "text", "text": f"describe picture {i}"}] + [
            {"type": "image_url", "image_url": {"url": f"s3://{bucket}/img-{i * images + j:05d}.jpg"}} for j in range(images)]
        body = {"model": VLM, "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"i-{i:05d}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return lines


def one_run(batch: Path, out: Path, env: dict[str, str], concurrency: int) -> dict[str, Any]:
    started = time.monotonic()
    done = subprocess.run([str(REPO / ".venv" / "bin" / "batch-pipeline"), "run", str(batch), "--output-dir", str(out)],
                          env={**env, "IMAGE_FETCH_CONCURRENCY": str(concurrency)}, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"batch-pipeline run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads((out / "_work" / "inference.json").read_text())
    counts = json.loads((out / "batch.json").read_text())["request_counts"]
    seconds = record["inference_seconds"]
    return {
        "concurrency": concurrency, "wall_seconds": round(wall, 1), "requests": counts["completed"],
        "failed": counts["failed"], "images": record.get("images", 0), "inference_seconds": seconds,
        "images_per_second": round(record.get("images", 0) / seconds, 1) if seconds else None,
        "image_wait_share": record.get("image_wait_share"), "engine_idle_share": record.get("engine_idle_share"),
        "model_load_seconds": record["model_load_seconds"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=240)
    parser.add_argument("--images", type=int, default=1, help="images per line")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", default="8", help="IMAGE_FETCH_CONCURRENCY values, comma-separated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", default="", help="write every run's figures here")
    args = parser.parse_args()

    os.environ.setdefault("BATCH_PIPELINE_CACHE", str(REPO / ".cache"))
    sys.path.insert(0, str(REPO))
    from batch_pipeline.config import models
    from batch_pipeline_tests.support.s3_server import running_moto_server
    from batch_pipeline_tests.support.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(models.cache_root() / "test-models" / VLM)
    bucket = "bench-images"
    say(f"drawing {args.lines * args.images} JPEGs")
    objects = {f"img-{n:05d}.jpg": jpeg(n) for n in range(args.lines * args.images)}
    say(f"{len(objects)} images, {sum(map(len, objects.values())) / len(objects) / 1024:.1f} KiB each on average")
    values = [int(v) for v in args.concurrency.split(",")]
    runs = []
    with running_moto_server(seed={bucket: objects}) as server, tempfile.TemporaryDirectory(prefix="bench-images-") as tmp:
        batch = Path(tmp) / "images.jsonl"
        batch.write_text("\n".join(batch_lines(args.lines, args.images, args.max_tokens, bucket)) + "\n")
        env = {**os.environ, **server.env(), "MODEL_PATH": str(vlm), "SERVED_MODEL_NAME": VLM, "MAX_MODEL_LEN": "512",
               "KV_CACHE_MEMORY_BYTES": str(64 * 2**20), "MAX_IMAGES_PER_REQUEST": str(max(args.images, 1))}
        env.pop("DAGSTER_HOME", None)
        for round_ in range(args.rounds):
            for concurrency in values if round_ % 2 == 0 else list(reversed(values)):
                out = Path(tmp) / f"out-{round_}-{concurrency}"
                figures = {"round": round_ + 1, **one_run(batch, out, env, concurrency)}
                runs.append(figures)
                say(json.dumps(figures))
    print(f"{args.lines} lines x {args.images} image(s) on the S3 test server, {args.max_tokens} tokens each, tiny Idefics3")
    print("| round | IMAGE_FETCH_CONCURRENCY | images | answering s | images/s | engine waited on images | engine idle |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        wait = f"{100 * r['image_wait_share']:.1f}%" if r["image_wait_share"] is not None else "-"
        idle = f"{100 * r['engine_idle_share']:.1f}%" if r["engine_idle_share"] is not None else "-"
        print(f"| {r['round']} | {r['concurrency']} | {r['images']} | {r['inference_seconds']:.1f} | "
              f"{r['images_per_second']} | {wait} | {idle} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""batch_upload_sensor over a bucket holding 1,000 / 20,000 / 100,000 batch files: tick time and
cursor size of the three triggers, with ratios against the full listing measured in the same run.

A script, not a test. From the repository root:

    .venv/bin/python bench/sensor_scale.py                        # 1,000, 20,000 and 100,000 files (~9 min on 2 cores)
    .venv/bin/python bench/sensor_scale.py --quick                # 1,000 and 5,000 files (~1 min)
    .venv/bin/python bench/sensor_scale.py --sizes 1000,20000 --idle-ticks 5 --json /tmp/sensor.json

The three triggers (README "Triggers"):
1. `all`: SENSOR_WINDOW_DAYS=all, every object listed each tick (the behaviour before the window;
   the baseline of every ratio);
2. `window`: SENSOR_WINDOW_DAYS unset, the top of the input folder and the last 3 date folders;
3. `queue`: INPUT_QUEUE_URL set to an SQS queue the bucket notifies on ObjectCreated.

How: moto's S3+SQS server runs as a subprocess (batch_pipeline_tests/support/s3_server.py) and is spoken to
over HTTP; the sensor is evaluated in this process (dg.build_sensor_context, as the tests do). One
bucket is filled incrementally (16 threads, notifications off) up to each size: old files in date
folders from the first partition onwards (100 per date, before the window), then, 3 s later so they
lie above the sensor's baseline as recent files would, 30 files in today's folder, 15 in
yesterday's and 5 at the top of `incoming/` (re-uploaded at every size, so the window holds the same
50 files whatever the history). SENSOR_BACKLOG=skip: the first tick requests nothing.

Per size and trigger, with a fresh cursor: the first tick; `--idle-ticks` ticks with nothing new
(median); one upload into today's folder and the tick after it (asserted: exactly 1 run request,
for that file); for window and queue one more tick (asserted: no run; in queue mode it deletes the
message; skipped for `all`, where it would cost another full listing). Printed:
tick times (wall, in this process, S3/SQS over local HTTP), the S3/SQS API calls of an idle tick
(counted with botocore event hooks on the pipeline's own clients), objects listed per tick, the
cursor's size in bytes after the new-upload tick, and ratios against `all` at the same size.

Caveats printed with the table: an idle queue tick includes one SQS long poll of
notifications.RECEIVE_WAIT_SECONDS (1 s) that comes back empty, and the new-upload tick one more
(the poll that finds the queue drained); that is waiting, not work. moto answers every LIST by
scanning every key of the bucket, whatever the prefix, unlike S3: a LIST of one small folder gets
slower as the bucket grows. The `moto LIST` control (one LIST of an empty prefix, median of 5) shows
that server cost per size; LIST calls and objects listed per tick are what carries over to S3.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import boto3
import dagster as dg
from botocore.config import Config

from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.defs.sensors import batch_upload_sensor, partition_range
from batch_pipeline.io import notifications
from batch_pipeline.io import storage as store
from batch_pipeline.io.uploads import BASELINE_SLACK_SECONDS
from batch_pipeline_tests.support.s3_server import (
    _FOREIGN_AWS_VARS,
    REGION,
    MotoS3,
    start_moto_server,
)

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
PER_DATE = 100  # old files per date folder
WINDOW_FILES = {0: 30, 1: 15}  # days before today -> recent files in that date folder
LOOSE_FILES = 5  # at the top of incoming/
RECENT = sum(WINDOW_FILES.values()) + LOOSE_FILES
OLD_BEFORE_DAYS = 7  # old date folders end this many days before today (well outside the 3-day window)
THREADS = 16
MODES = ("all", "window", "queue")
SENSOR_VARS = ("SENSOR_WINDOW_DAYS", "SENSOR_BACKLOG", "SENSOR_MAX_RUNS_PER_TICK", "INPUT_QUEUE_URL",
               "INPUT_QUEUE_VISIBILITY_SECONDS", "SHARDS")


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def day(offset: int) -> str:
    return (dt.date.fromisoformat(partition_range().last) - dt.timedelta(days=offset)).isoformat()


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Calls:
    """API calls made by the pipeline's own S3 and SQS clients (botocore before-call events)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def hook(self, service: str) -> Callable[..., None]:
        def count(**kwargs: Any) -> None:
            name = f"{service}.{kwargs['model'].name}"
            self.counts[name] = self.counts.get(name, 0) + 1
        return count

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)

    @staticmethod
    def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


class Bench:
    def __init__(self, server: MotoS3, args: argparse.Namespace) -> None:
        self.server, self.args = server, args
        config = Config(max_pool_connections=THREADS * 2, retries={"max_attempts": 5, "mode": "standard"})
        creds = {"endpoint_url": server.endpoint_url, "aws_access_key_id": "testing",
                 "aws_secret_access_key": "testing", "region_name": REGION}
        self.s3 = boto3.session.Session().client("s3", config=config, **creds)
        self.sqs = boto3.session.Session().client("sqs", **creds)
        self.bucket = f"bench-{uuid.uuid4().hex[:12]}"
        self.s3.create_bucket(Bucket=self.bucket)
        self.queue_url = self.sqs.create_queue(QueueName=f"uploads-{uuid.uuid4().hex[:12]}")["QueueUrl"]
        self.queue_arn = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self.storage = StorageResource(input_path=f"s3://{self.bucket}/incoming",
                                       output_path=f"s3://{self.bucket}/output")
        self.instance = dg.DagsterInstance.ephemeral()
        self.calls = Calls()
        self.old = 0  # old files uploaded so far
        first = dt.date.fromisoformat(partition_range().first)
        last_old = dt.date.fromisoformat(day(OLD_BEFORE_DAYS))
        self.old_dates = [(first + dt.timedelta(days=i)).isoformat() for i in range((last_old - first).days + 1)]
        self.recent = ([f"incoming/{day(offset)}/recent-{offset}-{i:02d}.jsonl"
                        for offset, n in WINDOW_FILES.items() for i in range(n)]
                       + [f"incoming/loose-{i}.jsonl" for i in range(LOOSE_FILES)])
        self._clients()

    # ------------------------------------------------------------------ environment

    def _clients(self) -> None:
        """Fresh pipeline clients (after an environment change), with the call counters hooked in."""
        store.reset_clients()
        store.s3_client().meta.events.register("before-call.s3", self.calls.hook("s3"))
        notifications.sqs_client().meta.events.register("before-call.sqs", self.calls.hook("sqs"))

    def use_mode(self, mode: str) -> None:
        for name in SENSOR_VARS:
            os.environ.pop(name, None)
        os.environ["SENSOR_BACKLOG"] = "skip"
        if mode == "all":
            os.environ["SENSOR_WINDOW_DAYS"] = "all"
        elif mode == "queue":
            os.environ["INPUT_QUEUE_URL"] = self.queue_url
        self._clients()

    def notify(self, on: bool) -> None:
        config: dict[str, Any] = {}
        if on:
            config = {"QueueConfigurations": [{
                "QueueArn": self.queue_arn, "Events": ["s3:ObjectCreated:*"],
                "Filter": {"Key": {"FilterRules": [{"Name": "prefix", "Value": "incoming/"}]}},
            }]}
        self.s3.put_bucket_notification_configuration(Bucket=self.bucket, NotificationConfiguration=config)

    def queue_depth(self) -> tuple[int, int]:
        attributes = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"])

    def drain(self) -> None:
        """Delete whatever is visible in the queue (PurgeQueue is allowed once a minute only)."""
        while True:
            messages = self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10,
                                                WaitTimeSeconds=0).get("Messages", [])
            if not messages:
                return
            self.sqs.delete_message_batch(QueueUrl=self.queue_url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])

    # ------------------------------------------------------------------ filling the bucket

    def _put_all(self, keys: list[str]) -> None:
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            list(pool.map(lambda key: self.s3.put_object(Bucket=self.bucket, Key=key, Body=LINE), keys))

    def fill(self, size: int) -> float:
        """Old files up to size - RECENT, then (3 s later) the recent ones; returns the seconds taken."""
        started = time.monotonic()
        target = size - RECENT
        keys = [f"incoming/{self.old_dates[(i // PER_DATE) % len(self.old_dates)]}/old-{i:06d}.jsonl"
                for i in range(self.old, target)]
        self._put_all(keys)
        self.old = target
        # The history ends before the sensor's baseline (newest file minus BASELINE_SLACK_SECONDS).
        time.sleep(BASELINE_SLACK_SECONDS + 1)
        self._put_all(self.recent)
        count = sum(page.get("KeyCount", 0) for page in
                    self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="incoming/"))
        assert count == size, f"the bucket holds {count} objects under incoming/, expected {size}"
        return time.monotonic() - started

    def empty_list_seconds(self, repeats: int = 5) -> float:
        """Control: one LIST of a prefix that holds nothing (what moto charges per LIST at this size)."""
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.s3.list_objects_v2(Bucket=self.bucket, Prefix="incoming/1999-01-01/", Delimiter="/")
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    # ------------------------------------------------------------------ ticks

    def tick(self, cursor: str | None) -> dict[str, Any]:
        context = dg.build_sensor_context(cursor=cursor, instance=self.instance, resources={"storage": self.storage})
        capture = Capture()
        for handler in list(context.log.handlers):  # the console copy: keep the output to the table
            context.log.removeHandler(handler)
        context.log.addHandler(capture)
        before = self.calls.snapshot()
        started = time.perf_counter()
        result = batch_upload_sensor(context)
        seconds = time.perf_counter() - started
        assert isinstance(result, dg.SensorResult), result
        listed = None
        for message in capture.messages:
            found = re.search(r"listed (\d+) objects", message) or re.search(r"received (\d+) message", message)
            if found:
                listed = int(found.group(1))
        return {"seconds": seconds, "result": result, "calls": Calls.since(before, self.calls.snapshot()),
                "listed": listed, "log": capture.messages}

    def measure(self, mode: str, size: int) -> dict[str, Any]:
        self.use_mode(mode)
        if mode == "queue":
            self.notify(True)
            self.drain()  # e.g. a test event sent when the notification is configured
            assert self.queue_depth() == (0, 0), self.queue_depth()
        first = self.tick(None)
        assert first["result"].run_requests == [], f"{mode}: first tick with SENSOR_BACKLOG=skip requested runs"
        cursor = first["result"].cursor
        idle = []
        for _ in range(self.args.idle_ticks):
            t = self.tick(cursor)
            assert t["result"].run_requests == [], f"{mode}: an idle tick requested {t['result'].run_requests}"
            idle.append(t)
            cursor = t["result"].cursor
        key = f"incoming/{day(0)}/brand-new-{mode}-{size}.jsonl"
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=LINE + LINE)
        new = self.tick(cursor)
        uris = [r.tags["batch_pipeline/input_uri"] for r in new["result"].run_requests]
        assert uris == [f"s3://{self.bucket}/{key}"], (
            f"{mode} at {size}: the tick after one upload requested {uris}, expected exactly that file; "
            f"log: {new['log']}")
        if mode != "all":  # a full listing costs ~40 s at 100,000 files here; the tests cover it
            after = self.tick(new["result"].cursor)
            assert after["result"].run_requests == [], f"{mode}: the file ran twice: {after['result'].run_requests}"
        self.s3.delete_object(Bucket=self.bucket, Key=key)  # every size starts from the same files
        if mode == "queue":
            self.notify(False)
            assert self.queue_depth() == (0, 0), f"queue not drained after the ticks: {self.queue_depth()}"
        median_idle = sorted(idle, key=lambda t: t["seconds"])[len(idle) // 2]
        return {
            "mode": mode,
            "size": size,
            "first_tick_seconds": first["seconds"],
            "idle_tick_seconds": statistics.median(t["seconds"] for t in idle),
            "idle_tick_seconds_all": [round(t["seconds"], 4) for t in idle],
            "new_upload_tick_seconds": new["seconds"],
            "idle_calls": median_idle["calls"],
            "new_calls": new["calls"],
            "idle_listed": median_idle["listed"],
            "new_listed": new["listed"],
            "cursor_bytes": len(new["result"].cursor.encode()),
            "cursor_bytes_idle": len(median_idle["result"].cursor.encode()),
        }


def calls_text(calls: dict[str, int]) -> str:
    short = {"s3.ListObjectsV2": "LIST", "s3.HeadObject": "HEAD", "s3.GetObject": "GET",
             "sqs.ReceiveMessage": "SQS-recv", "sqs.DeleteMessageBatch": "SQS-del"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in sorted(calls.items())) or "-"


def ratio(a: float, b: float) -> str:
    if not b:
        return "n/a"
    r = a / b
    return f"{r:.3f}" if abs(r) >= 0.01 else f"{r:.2g}"


def report(rows: list[dict[str, Any]], controls: dict[int, dict[str, float]], idle_ticks: int) -> None:
    print()
    print(f"batch_upload_sensor, moto S3/SQS over local HTTP, {os.cpu_count()} CPU(s); SENSOR_BACKLOG=skip; "
          f"idle = median of {idle_ticks} ticks with nothing new; new = the tick after one upload into today's folder")
    head = (f"{'files':>8} {'mode':<7} {'first s':>8} {'idle s':>8} {'new s':>8} {'listed':>7} "
            f"{'cursor B':>9} {'idle tick calls':<22} {'new-upload tick calls':<40}")
    print(head)
    print("-" * len(head))
    for r in rows:
        listed = "-" if r["idle_listed"] is None else str(r["idle_listed"])  # queue: messages received
        print(f"{r['size']:>8,} {r['mode']:<7} {r['first_tick_seconds']:>8.3f} {r['idle_tick_seconds']:>8.3f} "
              f"{r['new_upload_tick_seconds']:>8.3f} {listed:>7} {r['cursor_bytes']:>9,} "
              f"{calls_text(r['idle_calls']):<22} {calls_text(r['new_calls']):<40}")
    print()
    print("ratios against the full listing (mode all) at the same size, same run:")
    print(f"{'files':>8}  {'window/all idle':>15} {'queue/all idle':>15} {'window/all new':>15} "
          f"{'queue/all new':>14} {'window/all cursor':>17} {'queue/all cursor':>16}")
    by = {(r["size"], r["mode"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    for size in sizes:
        a, w, q = by[(size, "all")], by[(size, "window")], by[(size, "queue")]
        print(f"{size:>8,}  {ratio(w['idle_tick_seconds'], a['idle_tick_seconds']):>15} "
              f"{ratio(q['idle_tick_seconds'], a['idle_tick_seconds']):>15} "
              f"{ratio(w['new_upload_tick_seconds'], a['new_upload_tick_seconds']):>15} "
              f"{ratio(q['new_upload_tick_seconds'], a['new_upload_tick_seconds']):>14} "
              f"{ratio(w['cursor_bytes'], a['cursor_bytes']):>17} {ratio(q['cursor_bytes'], a['cursor_bytes']):>16}")
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        print()
        print(f"growth with the history, {hi:,} files / {lo:,} files (same mode, same run):")
        for mode in MODES:
            r_lo, r_hi = by[(lo, mode)], by[(hi, mode)]
            print(f"  {mode:<7} idle tick x{ratio(r_hi['idle_tick_seconds'], r_lo['idle_tick_seconds'])}, "
                  f"new-upload tick x{ratio(r_hi['new_upload_tick_seconds'], r_lo['new_upload_tick_seconds'])}, "
                  f"cursor x{ratio(r_hi['cursor_bytes'], r_lo['cursor_bytes'])}; idle tick calls "
                  f"{calls_text(r_lo['idle_calls'])} -> {calls_text(r_hi['idle_calls'])}, "
                  f"listed/received {r_lo['idle_listed']} -> {r_hi['idle_listed']}")
        print(f"  control: one moto LIST of an empty prefix x"
              f"{ratio(controls[hi]['empty_list_seconds'], controls[lo]['empty_list_seconds'])}")
    print()
    print("moto LIST control (one LIST of an empty prefix, median of 5) and fill time per size:")
    for size in sizes:
        c = controls[size]
        print(f"{size:>8,}  empty-prefix LIST {c['empty_list_seconds'] * 1000:8.1f} ms   "
              f"filled to this size in {c['fill_seconds']:.0f}s")
    wait = notifications.RECEIVE_WAIT_SECONDS
    print()
    print(f"derived, not measured apart: queue ticks minus their one empty {wait} s long poll "
          "(each queue tick above ends with exactly one ReceiveMessage that finds nothing):")
    for size in sizes:
        a, q = by[(size, "all")], by[(size, "queue")]
        idle, new = q["idle_tick_seconds"] - wait, q["new_upload_tick_seconds"] - wait
        print(f"{size:>8,}  queue idle {idle * 1000:7.1f} ms (/all {ratio(idle, a['idle_tick_seconds'])})   "
              f"queue new {new * 1000:7.1f} ms (/all {ratio(new, a['new_upload_tick_seconds'])})")
    print()
    print(f"notes: queue ticks include SQS long polls of {wait} s that come back empty (notifications.RECEIVE_WAIT_SECONDS): "
          f"one in an idle tick, one after the message in the new-upload tick; reported as is. "
          "'listed' = objects the idle tick listed (sensor log). moto scans every key of the bucket on each LIST "
          "whatever the prefix (S3 does not), so a LIST's time grows with the bucket here: see the control. "
          "cursor B = bytes of the cursor stored after the new-upload tick.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000,20000,100000",
                   help="bucket sizes (batch files), ascending, comma-separated (default 1000,20000,100000)")
    p.add_argument("--quick", action="store_true", help="sizes 1000,5000 (overrides --sizes)")
    p.add_argument("--idle-ticks", type=int, default=3, help="idle ticks per trigger and size; median reported")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    sizes = [1000, 5000] if args.quick else [int(x.replace("_", "")) for x in args.sizes.split(",") if x.strip()]
    if sizes != sorted(set(sizes)) or sizes[0] <= RECENT:
        p.error(f"--sizes must be ascending, distinct and above {RECENT}")
    if args.idle_ticks < 1:
        p.error("--idle-ticks must be at least 1")

    server = start_moto_server()
    saved = {name: os.environ.get(name) for name in (*_FOREIGN_AWS_VARS, *SENSOR_VARS, *server.env())}
    try:
        for name in _FOREIGN_AWS_VARS:
            os.environ.pop(name, None)
        os.environ.update(server.env())
        bench = Bench(server, args)
        say(f"moto at {server.endpoint_url}; bucket {bench.bucket}; sizes {sizes}; "
            f"{len(bench.old_dates)} old date folders ({bench.old_dates[0]} .. {bench.old_dates[-1]}); today {day(0)}")
        rows: list[dict[str, Any]] = []
        controls: dict[int, dict[str, float]] = {}
        for size in sizes:
            say(f"filling the bucket to {size:,} batch files ...")
            fill = bench.fill(size)
            controls[size] = {"fill_seconds": fill, "empty_list_seconds": bench.empty_list_seconds()}
            say(f"{size:,} files in the bucket ({fill:.0f}s); empty-prefix LIST "
                f"{controls[size]['empty_list_seconds'] * 1000:.1f} ms")
            for mode in MODES:
                row = bench.measure(mode, size)
                rows.append(row)
                say(f"{size:,} {mode}: first {row['first_tick_seconds']:.3f}s, idle {row['idle_tick_seconds']:.3f}s, "
                    f"new {row['new_upload_tick_seconds']:.3f}s, cursor {row['cursor_bytes']} B, "
                    f"idle calls {calls_text(row['idle_calls'])}")
        report(rows, controls, args.idle_ticks)
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "controls": {str(k): v for k, v in controls.items()}},
                                            indent=2))
            say(f"figures written to {args.json}")
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        store.reset_clients()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

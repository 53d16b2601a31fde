"""batch_upload_sensor over a bucket that already holds 20,000 batch files (issue: upload sensor at scale).

Covers, on moto's S3 server over HTTP with the sensor evaluated in-process: a tick lists the top of
the input folder and the window's date folders only (LIST calls counted through a proxy: the same
few whatever the history holds), and a new upload among the 20,000 is found in one tick; what is
there when the sensor is turned on with SENSOR_BACKLOG=skip (no run, small cursor) and =run (one
file run per window file, none for the history; with SENSOR_WINDOW_DAYS=all, every file of the
history, SENSOR_MAX_RUNS_PER_TICK per tick, each file once: on a bucket with the same 202 dates
and 6 old files a date, 2 LIST pages instead of 20 a tick); and, on small local folders, backlog
dates whose files a backfill completed (no run), a file landing in a date folder outside the
window (not seen; seen with a wider window), files deferred by the per-tick cap (run on a later
tick, none lost), a cursor stored by the sensor before the window existed (v1: nothing re-run),
and the settings' validation.

The old files are in the buckets when this module's moto server starts (s3_server.py's seed);
the recent ones are uploaded over HTTP after them.

The queue trigger (INPUT_QUEUE_URL) is test_sensor_queue.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.defs.sensors import partition_range
from batch_pipeline.io import storage as store
from batch_pipeline.config.settings import ConfigError, sensor_settings_from_env
from batch_pipeline.io.uploads import BASELINE_SLACK_SECONDS, LOOKBACK_SECONDS, UploadCursor
from batch_pipeline_tests.support.fault_proxy import FaultProxy, start_proxy
from batch_pipeline_tests.support.s3_server import MotoS3, apply_env, running_moto_server
from batch_pipeline_tests.support.sensor_ticks import by_uri, evaluate, write

pytestmark = pytest.mark.usefixtures("sensor_env")  # the sensor settings' defaults, whatever the shell has set

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
HISTORY_DATES = 200  # 2025-01-01 onwards, 100 files each
HISTORY_FILES = 19_950
WINDOW_FILES = {0: 30, 1: 15}  # days before today -> files in that date folder
LOOSE_FILES = 5  # at the top of the input folder: today's by upload date
HISTORY_BUCKET = "sensor-scale-history"
# The same 200 old dates with 6 files each (1,250 files with the recent ones: 2 LIST pages), for
# the test that lists the whole history tick after tick: moto takes ~0.7 s a page of 1,000 keys
# here, and a 20-page listing per tick made that test 40-60 s.
DATES_BUCKET, DATES_PER_DATE = "sensor-scale-dates", 6


def day(offset: int) -> str:
    return (dt.date.fromisoformat(partition_range().last) - dt.timedelta(days=offset)).isoformat()


def old_keys(files: int) -> list[str]:
    start = dt.date(2025, 1, 1)
    return [f"incoming/{(start + dt.timedelta(days=i % HISTORY_DATES)).isoformat()}/old-{i:05d}.jsonl"
            for i in range(files)]


def window_keys() -> list[str]:
    return [f"incoming/{day(offset)}/recent-{offset}-{i:02d}.jsonl" for offset, n in WINDOW_FILES.items() for i in range(n)]


def loose_keys() -> list[str]:
    return [f"incoming/loose-{i}.jsonl" for i in range(LOOSE_FILES)]


@pytest.fixture(scope="module")
def history_server() -> Iterator[MotoS3]:
    """A moto server of this module's own whose buckets hold the old files when it starts answering
    (put through moto's backend: 20,000 PUTs over HTTP took 1.5-3 minutes here)."""
    dates = old_keys(HISTORY_DATES * DATES_PER_DATE) + window_keys() + loose_keys()
    seed = {HISTORY_BUCKET: dict.fromkeys(old_keys(HISTORY_FILES), LINE), DATES_BUCKET: dict.fromkeys(dates, LINE)}
    with running_moto_server(seed=seed) as server:
        yield server


@pytest.fixture(scope="module")
def history(history_server: MotoS3) -> dict[str, Any]:
    """A bucket with 20,000 batch files: 19,950 in 200 old date folders, 45 in today's and
    yesterday's folders, 5 at the top of the input folder (uploaded last, in that order)."""
    client = history_server.client()
    window, loose = window_keys(), loose_keys()
    # The history ends well before the sensor's baseline (the newest file there minus
    # BASELINE_SLACK_SECONDS), as it would on any real bucket: time that must pass between the two.
    time.sleep(BASELINE_SLACK_SECONDS + 1)
    for group in (window, loose):
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda key: client.put_object(Bucket=HISTORY_BUCKET, Key=key, Body=LINE), group))
    return {"bucket": HISTORY_BUCKET, "client": client, "window": window, "loose": loose}


@pytest.fixture
def s3(history: dict[str, Any], history_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    apply_env(monkeypatch, history_server)
    yield history
    store.reset_clients()


@pytest.fixture
def list_counter(history_server: MotoS3) -> Iterator[FaultProxy]:
    """A FaultProxy in front of this module's server, counting the requests (no faults)."""
    proxy = start_proxy(history_server.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.stop()


def storage_for(bucket: str, output: str) -> StorageResource:
    return StorageResource(input_path=f"s3://{bucket}/incoming", output_path=f"s3://{bucket}/{output}")


def test_skip_backlog_then_a_new_upload_is_found_in_one_cheap_tick(s3, list_counter: FaultProxy, monkeypatch) -> None:
    monkeypatch.setenv("SENSOR_BACKLOG", "skip")
    monkeypatch.setenv("AWS_ENDPOINT_URL", list_counter.endpoint_url)  # to count the LIST calls
    store.reset_clients()
    bucket, client = s3["bucket"], s3["client"]
    storage = storage_for(bucket, "out-skip")

    log: list[str] = []
    on = evaluate(storage, log=log)
    assert on.run_requests == []
    in_window = len(s3["window"]) + len(s3["loose"])
    assert any("already there, on 2 date(s): left alone (SENSOR_BACKLOG=skip)" in m for m in log), log
    assert any(f"sensor turned on over {in_window} batch file(s)" in m for m in log), log
    assert len(on.cursor) < 2_000, on.cursor  # the backlog is a baseline time, not 20,000 ids

    # Nothing new: a tick lists the top of the folder and three date folders, not the history.
    lists_before = list_counter.count("GET", "list-type=2")
    log = []
    idle = evaluate(storage, on.cursor, log=log)
    assert idle.run_requests == []
    assert list_counter.count("GET", "list-type=2") - lists_before == 1 + 3
    assert any(f"listed {in_window} objects (3 date folder(s)" in m for m in log), log

    # A new upload among the 20,000 runs on the next tick, with the same few LIST calls.
    key = f"incoming/{day(0)}/brand-new.jsonl"
    client.put_object(Bucket=bucket, Key=key, Body=LINE + LINE)
    lists_before = list_counter.count("GET", "list-type=2")
    found = evaluate(storage, idle.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in found.run_requests] == [f"s3://{bucket}/{key}"]
    assert found.run_requests[0].partition_key == f"{day(0)}/brand-new"
    assert list_counter.count("GET", "list-type=2") - lists_before == 1 + 3
    assert len(found.cursor) < 2_000
    assert evaluate(storage, found.cursor).run_requests == []
    client.delete_object(Bucket=bucket, Key=key)  # the other tests count the fixture's files

    # The old way (every folder) reads the whole history: 20 LIST pages of 1,000 keys.
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")
    lists_before = list_counter.count("GET", "list-type=2")
    assert evaluate(storage, found.cursor).run_requests == []
    assert list_counter.count("GET", "list-type=2") - lists_before >= 20


def test_run_backlog_one_run_per_window_file(s3) -> None:
    bucket = s3["bucket"]
    storage = storage_for(bucket, "out-run")
    log: list[str] = []
    cursor, ticks, requests = None, 0, []
    while True:
        result = evaluate(storage, cursor, log=log)
        ticks += 1
        assert len(result.run_requests) <= 25  # SENSOR_MAX_RUNS_PER_TICK's default
        requests += result.run_requests
        cursor = result.cursor
        assert len(cursor) < 2_000  # where a date goes on is one URI, not the files done
        if not UploadCursor.parse(cursor).backlog:
            break
        assert ticks < 5
    # Today's and yesterday's folders plus the loose files of today: a run per file, each once, none
    # for the 19,950 files of 2025 outside the window.
    window = {f"s3://{bucket}/{key}" for key in s3["window"] + s3["loose"]}
    assert sorted(r.tags["batch_pipeline/input_uri"] for r in requests) == sorted(window)
    assert ticks == -(-len(window) // 25)
    for request in requests:
        assert request.job_name == "batch_file_job" and request.run_config == batch_run_config()
        assert request.partition_key.split("/")[0] in (day(0), day(1))
    assert any("SENSOR_BACKLOG=run" in m and f"{len(window)} batch file(s)" in m for m in log)
    assert evaluate(storage, cursor).run_requests == []  # each file once


def test_run_backlog_over_the_whole_history_is_capped_per_tick(s3, monkeypatch) -> None:
    """The 202 dates of the history (200 old, today and yesterday) over 2 LIST pages (DATES_BUCKET)."""
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")
    monkeypatch.setenv("SENSOR_MAX_RUNS_PER_TICK", "100")
    storage = storage_for(DATES_BUCKET, "out-all")
    files: list[str] = []
    cursor = None
    ticks = 0
    while True:
        result = evaluate(storage, cursor)
        ticks += 1
        assert len(result.run_requests) <= 100  # never thousands of runs from one tick
        files.extend(r.partition_key for r in result.run_requests)
        cursor = result.cursor
        if not UploadCursor.parse(cursor).backlog:
            break
        assert ticks < 20
    # Every file of the 202 dates once, one run each.
    assert len(files) == len(set(files)) == HISTORY_DATES * DATES_PER_DATE + len(window_keys()) + LOOSE_FILES
    assert len({f.split("/")[0] for f in files}) == HISTORY_DATES + 2
    assert ticks == -(-len(files) // 100)
    assert evaluate(storage, cursor).run_requests == []


# ------------------------------------------------------------------------ local, small


def local_storage(tmp_path: Path) -> StorageResource:
    return StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))


def completed_batch_json(tmp_path: Path, path: Path, date: str) -> None:
    info = store.describe(str(path))
    name = path.name.rsplit(".", 1)[0]
    target = tmp_path / "out" / date / name / "batch.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"status": "completed", "metadata": {"input_etag": info.etag}}))


def test_backlog_a_backfill_completed_starts_no_run(tmp_path: Path) -> None:
    """Turned on after a backfill of today and yesterday: yesterday is complete (no run); today has
    one file the backfill did not finish (its run)."""
    storage = local_storage(tmp_path)
    done = [write(tmp_path / "in" / day(1) / f"y{i}.jsonl", age_seconds=3600) for i in range(3)]
    today = [write(tmp_path / "in" / day(0) / f"t{i}.jsonl", age_seconds=3600) for i in range(2)]
    for path in done + today[:1]:
        completed_batch_json(tmp_path, path, path.parent.name)
    log: list[str] = []
    on = evaluate(storage, log=log)
    assert [r.partition_key for r in on.run_requests] == [f"{day(0)}/t1"]
    assert any(f"backlog of {day(1)}: 3 file(s)" in m and "all already completed; no run" in m for m in log), log
    assert any(f"backlog of {day(0)}: 2 file(s)" in m and "1 run(s)" in m for m in log), log


def test_a_file_outside_the_window_waits_for_a_backfill_or_a_wider_window(tmp_path: Path, monkeypatch) -> None:
    storage = local_storage(tmp_path)
    on = evaluate(storage).cursor
    late = write(tmp_path / "in" / day(5) / "late.jsonl")
    recent = write(tmp_path / "in" / day(2) / "recent.jsonl")
    result = evaluate(storage, on)
    assert [r.tags["batch_pipeline/input_uri"] for r in result.run_requests] == [str(recent)]
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "7")
    wider = evaluate(storage, result.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in wider.run_requests] == [str(late)]
    # Dated files of the window are remembered by id alone: a file of the window with an old mtime
    # (cp -p) still runs, unlike at the top of the folder, where the 24 h look-back applies.
    copied = write(tmp_path / "in" / day(1) / "copied.jsonl", age_seconds=LOOKBACK_SECONDS * 3)
    loose = write(tmp_path / "in" / "copied-loose.jsonl", age_seconds=LOOKBACK_SECONDS * 3)
    after = evaluate(storage, wider.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in after.run_requests] == [str(copied)]
    assert loose.exists()


def test_files_over_the_cap_wait_for_later_ticks(tmp_path: Path, monkeypatch) -> None:
    """Seven dates with a new file each and three loose files of today, at most 4 runs per tick: the
    files wait in upload order and each runs once, in a run of its own."""
    monkeypatch.setenv("SENSOR_MAX_RUNS_PER_TICK", "4")
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "10")
    storage = local_storage(tmp_path)
    cursor = evaluate(storage).cursor
    files = [write(tmp_path / "in" / day(i) / f"f{i}.jsonl", age_seconds=600 - i) for i in range(7)]
    loose = [write(tmp_path / "in" / f"loose{i}.jsonl", age_seconds=500 - i) for i in range(3)]
    order: list[str] = []
    log: list[str] = []
    for _ in range(3):
        result = evaluate(storage, cursor, log=log)
        assert len(result.run_requests) <= 4
        order.extend(r.tags["batch_pipeline/input_uri"] for r in result.run_requests)
        cursor = result.cursor
    assert order == [str(f) for f in files + loose]  # oldest first, each once, none lost
    assert any("wait for the next tick (SENSOR_MAX_RUNS_PER_TICK=4)" in m for m in log)
    assert evaluate(storage, cursor).run_requests == []


def test_a_cursor_from_before_the_window_reruns_nothing(tmp_path: Path) -> None:
    """A v1 cursor (mark + ids of the last 24 h) keeps its meaning: files it saw, and files older
    than its look-back, do not run again; a file uploaded since does."""
    from batch_pipeline.io.uploads import version_id

    storage = local_storage(tmp_path)
    ancient = write(tmp_path / "in" / day(1) / "ancient.jsonl", age_seconds=LOOKBACK_SECONDS + 7200)
    handled = [write(tmp_path / "in" / day(0) / f"{n}.jsonl", age_seconds=age) for n, age in (("a", 10800), ("b", 600))]
    v1 = json.dumps({"v": 1, "mark": handled[-1].stat().st_mtime,
                     "seen": [version_id(f"{day(0)}/{p.name}", store.describe(str(p)).etag) for p in handled]})
    new = write(tmp_path / "in" / day(0) / "c.jsonl", age_seconds=60)
    result = evaluate(storage, v1)
    assert list(by_uri(result)) == [str(new)]
    assert ancient.exists()
    assert UploadCursor.parse(result.cursor).since is not None
    assert evaluate(storage, result.cursor).run_requests == []


def test_sensor_settings_are_validated() -> None:
    assert sensor_settings_from_env({}).window_days == 3
    assert sensor_settings_from_env({"SENSOR_WINDOW_DAYS": "all"}).window_days is None
    for env, match in [
        ({"SENSOR_WINDOW_DAYS": "0"}, "SENSOR_WINDOW_DAYS='0' is out of range"),
        ({"SENSOR_WINDOW_DAYS": "week"}, "SENSOR_WINDOW_DAYS='week' is not a valid integer"),
        ({"SENSOR_BACKLOG": "later"}, "SENSOR_BACKLOG='later' is not one of run, skip"),
        ({"SENSOR_MAX_RUNS_PER_TICK": "0"}, "SENSOR_MAX_RUNS_PER_TICK='0' is out of range"),
        ({"INPUT_QUEUE_URL": "my-queue"}, "INPUT_QUEUE_URL='my-queue' is not an SQS queue URL"),
        ({"INPUT_QUEUE_VISIBILITY_SECONDS": "1"}, "INPUT_QUEUE_VISIBILITY_SECONDS='1' is out of range"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sensor_settings_from_env(env)


def test_a_bad_setting_fails_the_tick_naming_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SENSOR_BACKLOG", "sometimes")
    with pytest.raises(Exception, match="SENSOR_BACKLOG='sometimes'"):
        evaluate(local_storage(tmp_path))


def test_description_states_the_policy() -> None:
    from batch_pipeline.definitions import defs

    description = defs().resolve_sensor_def("batch_upload_sensor").description
    assert "date folders of the last 3 day(s)" in description
    assert "SENSOR_BACKLOG=run" in description and "at most 25 runs per tick" in description
    assert os.environ.get("SENSOR_WINDOW_DAYS") is None

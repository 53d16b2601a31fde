"""Tests for batch_upload_sensor (batch_pipeline/defs/sensors.py), evaluated in-process.

Covers: one RunRequest per new batch file (a batch_file_job run of its `<date>/<name>` partition) on S3 (moto's server over HTTP) and in a local folder;
the partition of dated (`<input>/<date>/x.jsonl`) and undated files (their upload date, UTC); run
keys `<uri>@<etag>`, run config and tags; repeated files (no new run), changed files (new ETag, new
run), more than 1,000 keys (listing pagination); the cursor round trip (a second evaluation with the
returned cursor asks for nothing) and its size; files ignored with a log line (folder that is not a
date, date outside the partitions, deeper paths, results written under the input folder); local
files still being written (left for the next tick); the look-back window; and the sensor as the
Definitions declare it (jobs, interval, default status, run requests valid for batch_file_job, and for
batch_job with SHARDS=n).

Does not touch the daemon, the UI or vLLM: Dagster's launching of the requested runs is covered by
test_dagster_e2e.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.defs.sensors import SENSOR_INTERVAL_SECONDS
from batch_pipeline.io.uploads import LOOKBACK_SECONDS, UploadCursor
from batch_pipeline_tests.support.s3_server import MotoS3
from batch_pipeline_tests.support.sensor_ticks import LINE, by_uri, evaluate, files_of, turned_on, write

pytestmark = pytest.mark.usefixtures("sensor_env")  # the sensor settings' defaults, whatever the shell has set


@pytest.fixture
def whole_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """SENSOR_WINDOW_DAYS=all: every date folder is listed (these tests use dates of 2025)."""
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")


def utc_date(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc).date().isoformat()


# --------------------------------------------------------------------------------------- S3


@pytest.fixture
def s3_storage(s3_bucket: str) -> StorageResource:
    return StorageResource(input_path=f"s3://{s3_bucket}/incoming", output_path=f"s3://{s3_bucket}/output")


@pytest.fixture
def client(moto_server: MotoS3) -> Any:
    """A boto3 client independent of the code under test."""
    return moto_server.client()


def put(client: Any, bucket: str, key: str, body: bytes = LINE) -> tuple[str, str, float]:
    """Upload; returns (uri, etag, last modified)."""
    client.put_object(Bucket=bucket, Key=key, Body=body)
    head = client.head_object(Bucket=bucket, Key=key)
    return f"s3://{bucket}/{key}", head["ETag"].strip('"'), head["LastModified"].timestamp()


def test_s3_new_dated_and_undated_files_become_runs(client, s3_bucket, s3_storage, whole_history) -> None:
    on = turned_on(s3_storage)
    dated, dated_etag, _ = put(client, s3_bucket, "incoming/2025-03-14/chat.jsonl")
    undated, undated_etag, modified = put(client, s3_bucket, "incoming/loose.ndjson")
    ignored = {
        "incoming/2025-13-45/bad-date.jsonl": "is not a date",
        "incoming/misc/notes.jsonl": "is not a date",
        "incoming/2023-12-31/too-early.jsonl": "before the first partition, 2024-01-01",
        "incoming/2999-01-01/far-future.jsonl": "not a partition yet",
        "incoming/2025-03-14/deeper/x.jsonl": "nested deeper",
    }
    for key in ignored:
        put(client, s3_bucket, key)
    put(client, s3_bucket, "incoming/readme.txt", b"not a batch")
    put(client, s3_bucket, "incoming/.uploading.jsonl")  # hidden: an upload in progress
    put(client, s3_bucket, "elsewhere/2025-03-14/other.jsonl")  # outside the input prefix

    log: list[str] = []
    result = evaluate(s3_storage, on, log=log)

    requests = by_uri(result)
    assert set(requests) == {dated, undated}
    # One run of batch_file_job per file, for its batch_files partition <date>/<name>.
    assert requests[dated].partition_key == "2025-03-14/chat"
    assert requests[undated].partition_key == f"{utc_date(modified)}/loose"
    for uri, etag, name in [(dated, dated_etag, "chat"), (undated, undated_etag, "loose")]:
        request = requests[uri]
        assert request.job_name == "batch_file_job"
        assert request.run_key == f"{uri}@{etag}"
        assert request.run_config == batch_run_config()  # the file is the partition key
        assert request.tags == {"batch_pipeline/input_uri": uri, "batch_pipeline/batch_name": name,
                                "batch_pipeline/date": request.partition_key.split("/")[0],
                                "batch_pipeline/engine": "in-process"}
    for key, reason in ignored.items():
        assert any(f"ignoring s3://{s3_bucket}/{key}: " in m and reason in m for m in log), key


def test_s3_repeated_and_changed_files(client, s3_bucket, s3_storage, whole_history) -> None:
    on = turned_on(s3_storage)
    first, first_etag, _ = put(client, s3_bucket, "incoming/2025-03-14/a.jsonl")
    result = evaluate(s3_storage, on)
    assert [r.run_key for r in result.run_requests] == [f"{first}@{first_etag}"]

    again = evaluate(s3_storage, result.cursor)  # nothing changed: nothing to run
    assert again.run_requests == []
    assert "no new batch files" in again.skip_reason.skip_message
    assert again.cursor == result.cursor

    # The same bytes again: same ETag, same run key, no run.
    put(client, s3_bucket, "incoming/2025-03-14/a.jsonl")
    assert evaluate(s3_storage, again.cursor).run_requests == []

    # New content under the same key: a new ETag and a new run; a new key alongside it.
    _, changed_etag, _ = put(client, s3_bucket, "incoming/2025-03-14/a.jsonl", LINE + LINE)
    second, second_etag, _ = put(client, s3_bucket, "incoming/2025-03-15/b.jsonl")
    changed = evaluate(s3_storage, again.cursor)
    assert changed_etag != first_etag
    assert sorted(r.run_key for r in changed.run_requests) == sorted(
        [f"{first}@{changed_etag}", f"{second}@{second_etag}"]
    )
    assert evaluate(s3_storage, changed.cursor).run_requests == []


def test_s3_more_than_1000_keys(client, s3_bucket, s3_storage, whole_history, monkeypatch) -> None:
    on = turned_on(s3_storage)
    keys = [f"incoming/2025-03-{10 + i % 3:02d}/part-{i:05d}.jsonl" for i in range(1000)]
    keys += [f"incoming/loose-{i:03d}.jsonl" for i in range(60)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=s3_bucket, Key=key, Body=LINE), keys))

    # 1,060 new files on four dates (the loose ones are today's): 1,000 runs (the most
    # SENSOR_MAX_RUNS_PER_TICK allows), then the other 60 on the next tick.
    monkeypatch.setenv("SENSOR_MAX_RUNS_PER_TICK", "1000")
    first = evaluate(s3_storage, on)
    assert len(first.run_requests) == 1000
    result = evaluate(s3_storage, first.cursor)
    assert len(result.run_requests) == 60
    result = dg.SensorResult(run_requests=first.run_requests + result.run_requests, cursor=result.cursor)
    files = files_of(result)
    assert set(files) == {f"s3://{s3_bucket}/{key}" for key in keys}
    partitions = [r.partition_key for r in result.run_requests]
    assert len(partitions) == len(set(partitions)) == len(keys)  # one run per file
    assert {p.split("/")[0] for p in partitions} > {"2025-03-10", "2025-03-11", "2025-03-12"}  # and today's
    for request in result.run_requests:
        date, name = request.partition_key.split("/")
        assert request.run_key.startswith(f"s3://{s3_bucket}/incoming/")
        assert request.run_key.split("@")[0].endswith(f"/{name}.jsonl")
    # Compact: about 15 bytes per file (a 12-digit version id), not the file's URI and ETag.
    assert len(result.cursor) < 20 * len(keys)
    assert len(UploadCursor.parse(result.cursor).seen) == len(keys)

    assert evaluate(s3_storage, result.cursor).run_requests == []  # the cursor round trip


def test_s3_missing_bucket_fails_the_tick(moto_server, s3_env) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-bucket"):
        evaluate(StorageResource(input_path="s3://no-such-bucket/incoming", output_path="/tmp/unused"))


# ------------------------------------------------------------------------------------ local


def test_local_folder(tmp_path: Path, whole_history) -> None:
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "in" / "results"))
    on = turned_on(storage)
    dated = write(tmp_path / "in" / "2025-03-14" / "a.jsonl")
    undated = write(tmp_path / "in" / "b.json", age_seconds=3 * 3600)
    write(tmp_path / "in" / "2025-02-30" / "c.jsonl")  # no such day
    write(tmp_path / "in" / "results" / "2025-03-14" / "a" / "output.jsonl")  # our own results
    write(tmp_path / "in" / "results" / "x.jsonl")

    log: list[str] = []
    result = evaluate(storage, on, log=log)
    requests = by_uri(result)
    assert set(requests) == {str(dated), str(undated)}
    assert requests[str(dated)].partition_key == "2025-03-14/a"
    assert requests[str(undated)].partition_key == f"{utc_date(undated.stat().st_mtime)}/b"
    st = dated.stat()
    assert requests[str(dated)].run_key == f"{dated}@{st.st_mtime_ns}-{st.st_size}"
    assert any("2025-02-30" in m and "is not a date" in m for m in log)
    assert not any("results" in m for m in log)  # results are skipped silently

    assert evaluate(storage, result.cursor).run_requests == []

    # A file written this instant may still be growing: it waits for a later tick, then runs once.
    fresh = tmp_path / "in" / "2025-03-14" / "fresh.jsonl"
    fresh.write_bytes(LINE)
    waiting = evaluate(storage, result.cursor)
    assert waiting.run_requests == []
    os.utime(fresh, (time.time() - 10, time.time() - 10))
    later = evaluate(storage, waiting.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in later.run_requests] == [str(fresh)]

    # Rewritten in place: new mtime and size, so a new etag and a new run.
    write(dated, age_seconds=5.5, body=LINE + LINE)
    rewritten = evaluate(storage, later.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in rewritten.run_requests] == [str(dated)]
    assert rewritten.run_requests[0].run_key != requests[str(dated)].run_key


def test_local_cursor_forgets_files_older_than_the_lookback(tmp_path: Path, whole_history) -> None:
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    on = turned_on(storage)
    for i in range(3):
        write(tmp_path / "in" / "2025-01-01" / f"old-{i}.jsonl", age_seconds=3 * 86400)
    first = evaluate(storage, on)
    assert len(first.run_requests) == len(files_of(first)) == 3  # one run per file

    newest = write(tmp_path / "in" / "2025-01-02" / "new.jsonl", age_seconds=60)
    second = evaluate(storage, first.cursor)
    assert [r.tags["batch_pipeline/input_uri"] for r in second.run_requests] == [str(newest)]
    cursor = UploadCursor.parse(second.cursor)
    assert cursor.mark == pytest.approx(newest.stat().st_mtime)
    assert len(cursor.seen) == 1  # the old files are below mark - LOOKBACK: no longer listed

    # The documented limit: a file arriving with an mtime far older than the newest file seen
    # (cp -p of an old file) counts as handled. The nightly schedule still picks up dated ones.
    late = write(tmp_path / "in" / "2025-01-01" / "late.jsonl", age_seconds=LOOKBACK_SECONDS + 3600)
    assert evaluate(storage, second.cursor).run_requests == []
    assert late.exists()


def test_same_batch_name_on_one_date_is_not_run(tmp_path: Path, whole_history) -> None:
    """<output>/<date>/<name>/ would receive both files' results: neither new file runs, each is logged."""
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    on = turned_on(storage)
    first = write(tmp_path / "in" / "2025-03-14" / "orders.jsonl")
    ran = evaluate(storage, on)
    assert [r.tags["batch_pipeline/input_uri"] for r in ran.run_requests] == [str(first)]

    second = write(tmp_path / "in" / "2025-03-14" / "orders.json", age_seconds=30)  # same name, same date
    other_day = write(tmp_path / "in" / "orders.jsonl", age_seconds=30)  # undated: today, another date
    log: list[str] = []
    result = evaluate(storage, ran.cursor, log=log)
    assert [r.tags["batch_pipeline/input_uri"] for r in result.run_requests] == [str(other_day)]
    assert any(m.startswith(f"ignoring {second}: {first} is also batch 'orders' of 2025-03-14") for m in log), log
    assert evaluate(storage, result.cursor).run_requests == []  # logged once, not every tick


def test_missing_local_folder_skips(tmp_path: Path) -> None:
    result = evaluate(StorageResource(input_path=str(tmp_path / "nowhere"), output_path=str(tmp_path / "out")))
    assert result.run_requests == []
    cursor = json.loads(result.cursor)
    assert cursor == {"v": 2, "since": pytest.approx(time.time(), abs=60), "mark": None, "seen": []}


def test_unknown_cursor_version_is_refused(tmp_path: Path) -> None:
    storage = StorageResource(input_path=str(tmp_path), output_path=str(tmp_path / "out"))
    with pytest.raises(Exception, match="unknown batch_upload_sensor cursor version"):
        evaluate(storage, json.dumps({"v": 99}))


# ------------------------------------------------------------------------------ definitions


def test_sensor_as_defined_and_requests_valid_for_its_jobs(tmp_path: Path, whole_history, monkeypatch) -> None:
    from batch_pipeline.definitions import defs

    definitions = defs()
    sensor = definitions.resolve_sensor_def("batch_upload_sensor")
    assert sorted(t.job_name for t in sensor.targets) == ["batch_file_job", "batch_job"]  # files; SHARDS=n
    assert sensor.minimum_interval_seconds == SENSOR_INTERVAL_SECONDS == 30
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    assert sensor.required_resource_keys == {"storage"}

    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    on = turned_on(storage)
    write(tmp_path / "in" / "2025-03-14" / "a.jsonl")
    result = evaluate(storage, on)
    (request,) = result.run_requests
    job = definitions.resolve_job_def(request.job_name)
    assert job.partitions_def.name == "batch_files"
    [added] = result.dynamic_partitions_requests  # the partition exists before the run is launched
    assert list(added.partition_keys) == [request.partition_key] == ["2025-03-14/a"]
    dg.validate_run_config(job, request.run_config)
    # With SHARDS=n: n line-range runs of batch_job for the file's date.
    monkeypatch.setenv("SHARDS", "2")
    write(tmp_path / "in" / "2025-03-14" / "b.jsonl")
    shards = evaluate(storage, result.cursor).run_requests
    assert [(r.job_name, r.partition_key, r.tags["batch_pipeline/shard"]) for r in shards] == [
        ("batch_job", "2025-03-14", "1/2"), ("batch_job", "2025-03-14", "2/2")]
    for r in shards:
        dg.validate_run_config(definitions.resolve_job_def("batch_job"), r.run_config)


def test_s3_file_versions_already_completed_start_no_run(client, s3_bucket, s3_storage, whole_history) -> None:
    """Files a backfill completed (same ETag) start no run; a file changed since, or one whose batch
    did not complete, does."""
    on = turned_on(s3_storage)
    done, done_etag, _ = put(client, s3_bucket, "incoming/2025-03-14/done.jsonl")
    changed, _, _ = put(client, s3_bucket, "incoming/2025-03-14/changed.jsonl", LINE + LINE)
    cancelled, cancelled_etag, _ = put(client, s3_bucket, "incoming/2025-03-14/cancelled.jsonl")

    def batch_json(name: str, status: str, etag: str) -> None:
        body = json.dumps({"status": status, "metadata": {"input_etag": etag}}).encode()
        client.put_object(Bucket=s3_bucket, Key=f"output/2025-03-14/{name}/batch.json", Body=body)

    batch_json("done", "completed", done_etag)
    batch_json("changed", "completed", "etag-of-an-older-version")
    batch_json("cancelled", "cancelled", cancelled_etag)

    log: list[str] = []
    result = evaluate(s3_storage, on, log=log)
    assert set(files_of(result)) == {changed, cancelled}
    assert any(done in m and "already completed" in m for m in log)
    # The cursor still marks the completed file as seen: the next tick does not look at it again.
    assert evaluate(s3_storage, result.cursor).run_requests == []


def test_new_files_of_one_date_are_one_run_each(tmp_path: Path, whole_history, monkeypatch) -> None:
    """Three new files of a date are three runs (each red or green on its own), in upload order, each
    tagged with its file, date and engine; each file's batch_files partition is added; the same file
    versions ask for the same run keys again. On a warm engine the engine tag is its URL (the run
    queue's limit per engine counts it)."""
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    on = turned_on(storage)
    trio = [write(tmp_path / "in" / "2025-03-14" / f"{n}.jsonl", age_seconds=90 - i) for i, n in enumerate("abc")]
    lone = write(tmp_path / "in" / "2025-03-15" / "d.jsonl")
    monkeypatch.setenv("ENGINE_URL", "http://engine.example:8000")
    result = evaluate(storage, on)
    assert [r.partition_key for r in result.run_requests] == ["2025-03-14/a", "2025-03-14/b", "2025-03-14/c",
                                                              "2025-03-15/d"]
    for request, path in zip(result.run_requests, trio + [lone]):
        st = path.stat()
        assert request.run_key == f"{path}@{st.st_mtime_ns}-{st.st_size}"
        assert request.tags["batch_pipeline/input_uri"] == str(path)
        assert request.tags["batch_pipeline/date"] == path.parent.name
        assert request.tags["batch_pipeline/engine"] == "http://engine.example:8000"
    again = evaluate(storage, on).run_requests
    assert [r.run_key for r in again] == [r.run_key for r in result.run_requests]
    # Each queued file gets its batch_files partition at once, so it shows in the UI while it waits.
    [added] = result.dynamic_partitions_requests
    assert added.partitions_def_name == "batch_files"
    assert list(added.partition_keys) == ["2025-03-14/a", "2025-03-14/b", "2025-03-14/c", "2025-03-15/d"]


def test_sensor_runs_take_a_configurable_priority(tmp_path: Path, whole_history, monkeypatch) -> None:
    from batch_pipeline.config.priority import PRIORITY_TAG, TURN_SPAN

    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    on = turned_on(storage)
    write(tmp_path / "in" / "2025-03-14" / "a.jsonl")
    write(tmp_path / "in" / "2025-03-15" / "b.jsonl")
    assert all(PRIORITY_TAG not in r.tags for r in evaluate(storage, on).run_requests)  # default: priority 0
    monkeypatch.setenv("SENSOR_RUN_PRIORITY", "7")
    result = evaluate(storage, on)
    assert len(result.run_requests) == 2
    for request in result.run_requests:
        assert request.tags[PRIORITY_TAG] == str(7 * TURN_SPAN)
        assert request.tags["batch_pipeline/priority"] == "7"
        assert request.tags["batch_pipeline/input_uri"]  # the sensor's own tags are kept
    assert result.cursor  # and so is the rest of the tick's result
    monkeypatch.setenv("SENSOR_RUN_PRIORITY", "high")
    with pytest.raises(Exception, match="SENSOR_RUN_PRIORITY='high' is not a valid integer"):
        evaluate(storage, result.cursor)


def test_every_file_there_becomes_a_partition_without_a_run(tmp_path: Path, monkeypatch) -> None:
    """file_partitions_sensor (on by default): the files of the window, dated and loose, each get their
    batch_files partition, so the UI can backfill them as one run each; it asks for no run, adds
    only keys not there yet, and skips an empty or missing input folder, saying so."""
    from batch_pipeline.definitions import defs
    from batch_pipeline.defs.sensors import file_partitions_sensor

    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "3")
    today = dt.datetime.now(dt.timezone.utc).date()
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "in" / "results"))
    instance = dg.DagsterInstance.ephemeral()

    def tick() -> dg.SensorResult:
        return file_partitions_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage}))

    assert tick().skip_reason.skip_message.startswith(f"no batch files under {tmp_path / 'in'}")  # none yet
    yesterday = (today - dt.timedelta(days=1)).isoformat()
    write(tmp_path / "in" / yesterday / "a.jsonl")
    write(tmp_path / "in" / yesterday / "b.csv")
    write(tmp_path / "in" / "loose.jsonl", age_seconds=10)
    write(tmp_path / "in" / (today - dt.timedelta(days=9)).isoformat() / "old.jsonl")  # outside the window
    write(tmp_path / "in" / "results" / yesterday / "a" / "output.jsonl")  # our own results
    result = tick()
    assert not result.run_requests
    [added] = result.dynamic_partitions_requests
    assert sorted(added.partition_keys) == sorted([f"{yesterday}/a", f"{yesterday}/b", f"{utc_date(time.time() - 10)}/loose"])
    instance.add_dynamic_partitions("batch_files", list(added.partition_keys))
    assert "each a batch_files partition already" in tick().skip_reason.skip_message
    write(tmp_path / "in" / yesterday / "c.jsonl")
    assert list(tick().dynamic_partitions_requests[0].partition_keys) == [f"{yesterday}/c"]
    sensor = defs().resolve_sensor_def("file_partitions_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING and not sensor.targets

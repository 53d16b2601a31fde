"""batch_upload_sensor draining S3 event notifications from SQS (INPUT_QUEUE_URL), evaluated in-process.

Covers, on moto's server over HTTP (S3 and SQS, the bucket notifying the queue on ObjectCreated as
AWS does): uploads become runs with the same run keys, partitions and config as the listing gives,
what is not a batch file (other suffixes, hidden files, other prefixes, results, S3's test event)
starts nothing, a completed file version starts nothing; messages are deleted by the tick after
the one whose run requests carried them, and the queue ends empty; a tick whose result is lost (the
daemon died before storing it) loses no file: the messages come back after
INPUT_QUEUE_VISIBILITY_SECONDS and ask for the same run keys; SENSOR_MAX_RUNS_PER_TICK with the
surplus released at once; SENSOR_BACKLOG=skip with a queue; the message formats (SNS-wrapped,
URL-encoded keys, removals); a queue that does not exist fails the tick naming INPUT_QUEUE_URL.

The same path through a real `dagster dev` with a daemon restart is test_dagster_e2e.py.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import pytest

from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.io import notifications
from batch_pipeline.io import storage as store
from batch_pipeline.io.uploads import BASELINE_SLACK_SECONDS, UploadCursor
from batch_pipeline_tests.support.s3_server import MotoS3
from batch_pipeline_tests.support.sensor_ticks import by_uri, evaluate, files_of
from batch_pipeline_tests.support.sqs_queue import notifying_queue, queue_depth
from batch_pipeline_tests.support import wait_for

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def queued(moto_server: MotoS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for name in ("SENSOR_WINDOW_DAYS", "SENSOR_BACKLOG", "SENSOR_MAX_RUNS_PER_TICK", "INPUT_QUEUE_VISIBILITY_SECONDS", "SHARDS"):
        monkeypatch.delenv(name, raising=False)
    url = notifying_queue(moto_server, s3_bucket)
    monkeypatch.setenv("INPUT_QUEUE_URL", url)
    store.reset_clients()
    storage = StorageResource(input_path=f"s3://{s3_bucket}/incoming", output_path=f"s3://{s3_bucket}/output")
    yield {"bucket": s3_bucket, "url": url, "storage": storage, "client": moto_server.client()}
    store.reset_clients()


def put(q: dict[str, Any], key: str, body: bytes = LINE) -> tuple[str, str, float]:
    q["client"].put_object(Bucket=q["bucket"], Key=key, Body=body)
    head = q["client"].head_object(Bucket=q["bucket"], Key=key)
    return f"s3://{q['bucket']}/{key}", head["ETag"].strip('"'), head["LastModified"].timestamp()


def utc_date(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, tz=dt.timezone.utc).date().isoformat()


def test_uploads_become_runs_and_messages_are_deleted_by_the_next_tick(queued, moto_server) -> None:
    storage = queued["storage"]
    on = evaluate(storage)  # turned on: nothing queued yet (moto sends no test event)
    assert on.run_requests == []

    dated, dated_etag, _ = put(queued, "incoming/2025-03-14/chat.jsonl")
    loose, loose_etag, loose_modified = put(queued, "incoming/my notes.ndjson")  # URL-encoded in the event
    done, done_etag, _ = put(queued, "incoming/2025-03-14/done.jsonl")
    queued["client"].put_object(Bucket=queued["bucket"], Key="output/2025-03-14/done/batch.json",
                                Body=json.dumps({"status": "completed", "metadata": {"input_etag": done_etag}}).encode())
    for key in ("incoming/readme.txt", "incoming/.part.jsonl", "incoming/2025-13-01/x.jsonl", "incoming/a/b/c.jsonl"):
        put(queued, key)
    assert queue_depth(moto_server, queued["url"])[0] == 7  # one message per object under incoming/

    log: list[str] = []
    first = evaluate(storage, on.cursor, log=log)
    requests = by_uri(first)
    assert set(requests) == {dated, loose}
    assert requests[dated].run_key == f"{dated}@{dated_etag}" and requests[dated].partition_key == "2025-03-14/chat"
    assert requests[loose].run_key == f"{loose}@{loose_etag}"
    assert requests[loose].partition_key == f"{utc_date(loose_modified)}/my notes"
    assert requests[dated].job_name == "batch_file_job" and requests[dated].run_config == batch_run_config()
    assert any(done in m and "already completed" in m for m in log)
    assert any("2025-13-01/x.jsonl: folder '2025-13-01' is not a date" in m for m in log), log
    assert any("a/b/c.jsonl: nested deeper" in m for m in log), log
    cursor = UploadCursor.parse(first.cursor)
    assert len(cursor.delete) == 7 and cursor.seen == set()
    assert queue_depth(moto_server, queued["url"]) == (0, 7)  # received, not deleted yet

    second = evaluate(storage, first.cursor, log=log)  # the run requests are stored: delete
    assert second.run_requests == []
    assert UploadCursor.parse(second.cursor).delete == []
    assert queue_depth(moto_server, queued["url"]) == (0, 0)
    assert any("deleted 7 message(s) the last tick handled" in m for m in log)


def test_a_tick_lost_before_its_run_requests_were_stored_loses_no_file(queued, moto_server, monkeypatch) -> None:
    """The daemon dies after receiving (its cursor is never stored): the message comes back once its
    invisible time is over, and the next tick asks for the same run key. Dagster starts a run key
    once, so a message read twice starts one run."""
    monkeypatch.setenv("INPUT_QUEUE_VISIBILITY_SECONDS", "5")
    storage = queued["storage"]
    stored = evaluate(storage).cursor
    uri, etag, _ = put(queued, f"incoming/{utc_date(time.time())}/late-night.jsonl")

    lost = evaluate(storage, stored)  # its result never reaches the instance
    assert [r.run_key for r in lost.run_requests] == [f"{uri}@{etag}"]
    assert evaluate(storage, stored).run_requests == []  # still invisible: nothing to read yet
    assert queue_depth(moto_server, queued["url"]) == (0, 1)  # not deleted

    wait_for("the message visible again after its 5 s", lambda: queue_depth(moto_server, queued["url"]) == (1, 0), 30,
             interval=0.25, on_timeout=lambda: f"(visible, in flight): {queue_depth(moto_server, queued['url'])}")
    again = evaluate(storage, stored)
    assert [r.run_key for r in again.run_requests] == [f"{uri}@{etag}"]
    after = evaluate(storage, again.cursor)
    assert after.run_requests == []
    assert queue_depth(moto_server, queued["url"]) == (0, 0)


def test_at_most_the_cap_per_tick_and_the_rest_released(queued, moto_server, monkeypatch) -> None:
    monkeypatch.setenv("SENSOR_MAX_RUNS_PER_TICK", "3")
    storage = queued["storage"]
    cursor = evaluate(storage).cursor
    uris = {put(queued, f"incoming/2025-03-{10 + i:02d}/f{i}.jsonl")[0] for i in range(8)}  # 8 dates
    uris |= {put(queued, f"incoming/2025-03-10/g{i}.jsonl")[0] for i in range(2)}  # a run each too
    asked: list[str] = []
    for _ in range(5):  # 3 + 3 + 3 + 1, and a tick that deletes the last message
        result = evaluate(storage, cursor)
        assert len(result.run_requests) <= 3
        asked.extend(files_of(result))
        cursor = result.cursor
    assert sorted(asked) == sorted(uris)  # each once, none lost
    assert queue_depth(moto_server, queued["url"]) == (0, 0)


def test_skip_backlog_with_a_queue(queued, monkeypatch) -> None:
    monkeypatch.setenv("SENSOR_BACKLOG", "skip")
    storage = queued["storage"]
    before, _, _ = put(queued, "incoming/2025-03-14/before.jsonl")  # queued before the sensor is on
    # Time that must pass: the sensor's baseline is after this file (S3 times have whole seconds).
    time.sleep(BASELINE_SLACK_SECONDS + 1.1)
    log: list[str] = []
    on = evaluate(storage, log=log)
    assert on.run_requests == []
    assert any(f"ignoring {before}: uploaded before the sensor was turned on (SENSOR_BACKLOG=skip)" in m for m in log)
    # Uploaded at once, possibly within the same (whole) second as the first tick: still runs.
    after, _, _ = put(queued, "incoming/2025-03-14/after.jsonl")
    assert list(by_uri(evaluate(storage, on.cursor))) == [after]


def test_a_missing_queue_fails_the_tick_naming_it(moto_server, s3_bucket, monkeypatch) -> None:
    url = f"{moto_server.endpoint_url}/123456789012/no-such-queue"
    monkeypatch.setenv("INPUT_QUEUE_URL", url)
    store.reset_clients()
    storage = StorageResource(input_path=f"s3://{s3_bucket}/incoming", output_path=f"s3://{s3_bucket}/output")
    with pytest.raises(Exception, match=f"INPUT_QUEUE_URL={url}: ReceiveMessage failed"):
        evaluate(storage)
    store.reset_clients()


def test_a_queue_with_a_local_input_folder_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("INPUT_QUEUE_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/uploads")
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    with pytest.raises(Exception, match="INPUT_QUEUE_URL is set but STORAGE_INPUT_PATH=.* is not on S3"):
        evaluate(storage)


def test_message_formats() -> None:
    record = {"eventName": "ObjectCreated:CompleteMultipartUpload",
              "s3": {"bucket": {"name": "b"}, "object": {"key": "in/2026-12-01/a+b%2Bc.jsonl", "eTag": "x"}}}
    direct = json.dumps({"Records": [record]})
    assert notifications.created_objects(direct) == ([notifications.Created("s3://b/in/2026-12-01/a b+c.jsonl", record["eventName"])], "")
    sns = json.dumps({"Type": "Notification", "Message": direct})
    assert notifications.created_objects(sns) == notifications.created_objects(direct)
    removed = json.dumps({"Records": [{**record, "eventName": "ObjectRemoved:Delete"}]})
    assert notifications.created_objects(removed) == ([], "no ObjectCreated record")
    assert notifications.created_objects(json.dumps({"Event": "s3:TestEvent", "Bucket": "b"}))[1].startswith("S3's test event")
    assert notifications.created_objects("not json") == ([], "not JSON")
    assert notifications.created_objects(json.dumps({"hello": 1})) == ([], "no Records: not an S3 event notification")

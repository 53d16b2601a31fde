"""batch_upload_sensor evaluated in-process, one tick at a time, and the files it finds.

Holds one tick of the sensor on a StorageResource (`evaluate`, what it logs collected in a list),
the cursor of its first tick over an empty input folder (`turned_on`), a tick's run requests by
input file (`by_uri`, `files_of`), a finished local batch file of a given age (`write`), and the
`sensor_env` fixture (the sensor settings' defaults, whatever the calling shell has set). Used by
test_sensors.py, test_sensor_queue.py, test_sensor_scale.py, test_shards.py and test_tables.py.

conftest.py registers this module as a plugin, so `sensor_env` is not autouse here (it would reach
every test of the suite): test_sensors.py and test_sensor_scale.py apply it to each of their tests
with `pytestmark = pytest.mark.usefixtures("sensor_env")`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.defs.sensors import batch_upload_sensor
from batch_pipeline.io.uploads import UploadCursor

# In memory: the sensor only reads its cursor from the context (a SQLite instance costs ~1 s each).
INSTANCE = dg.DagsterInstance.ephemeral()
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class ListHandler(logging.Handler):
    def __init__(self, messages: list[str]):
        super().__init__(logging.INFO)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def evaluate(storage: StorageResource, cursor: str | None = None, log: list[str] | None = None) -> dg.SensorResult:
    """One tick of the sensor; what it logs is appended to `log`."""
    context = dg.build_sensor_context(cursor=cursor, instance=INSTANCE, resources={"storage": storage})
    context.log.addHandler(ListHandler(log if log is not None else []))
    result = batch_upload_sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


def turned_on(storage: StorageResource) -> str:
    """The cursor of the sensor's first tick over an empty input folder: files put there afterwards
    are new uploads, not the backlog of what was there when the sensor was turned on."""
    first = evaluate(storage)
    assert first.run_requests == []
    assert UploadCursor.parse(first.cursor).since is not None
    return first.cursor


@pytest.fixture
def sensor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sensor settings' defaults, whatever the calling shell has set."""
    for name in ("SENSOR_WINDOW_DAYS", "SENSOR_BACKLOG", "SENSOR_MAX_RUNS_PER_TICK", "INPUT_QUEUE_URL",
                 "INPUT_QUEUE_VISIBILITY_SECONDS", "SHARDS"):
        monkeypatch.delenv(name, raising=False)


def by_uri(result: dg.SensorResult) -> dict[str, dg.RunRequest]:
    requests = {r.tags["batch_pipeline/input_uri"]: r for r in result.run_requests or []}
    assert len(requests) == len(result.run_requests or [])
    return requests


def files_of(result: dg.SensorResult) -> dict[str, dg.RunRequest]:
    """Input file -> the run request that takes it (its tag; with SHARDS=n, the first shard's);
    each file's runs in one place."""
    found: dict[str, dg.RunRequest] = {}
    for request in result.run_requests or []:
        uri = request.tags["batch_pipeline/input_uri"]
        assert uri not in found or "batch_pipeline/shard" in request.tags, uri
        found.setdefault(uri, request)
    return found


def write(path: Path, age_seconds: float = 60.0, body: bytes = LINE) -> Path:
    """A finished local batch file, last modified `age_seconds` ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path

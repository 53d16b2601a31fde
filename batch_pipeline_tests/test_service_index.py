"""The Batch API's index of open batches: what create reads for the per-tenant limit check.

Covered: with a tenant's history of 500 finished batches, create reads the tenant's open batches
only (reads counted through storage: every JSON read, service records and the pipeline's files),
the same as with no history; a batch seen finished leaves the index, and reading it again writes
nothing; a store kept before the index existed is indexed once, and only its batches not known to
be over. The service is the real `Service` over a real local store; the Dagster web server is a
stand-in answering submit and run status (what it answers does not change what the store reads:
a run query is not a storage read). The service over a real `dagster dev`: test_batch_api.py's
limit test.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.io import storage
from batch_pipeline.service.store import Store

TENANT = "team-a"
LINE = b'{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
BATCH_IDS = re.compile(r"batch_(?:[0-9a-f]{24}|past[0-9]{6})")


class RunsStandIn:
    """The Dagster web server's answers the service needs here: a run id at submit, its status after."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}

    def submit(self, record: dict[str, Any]) -> str:
        record["turn"] = 0
        self.status[record["id"]] = "QUEUED"
        return f"run-{record['id']}"

    def current_run(self, record: dict[str, Any]) -> tuple[str, str | None]:
        return record["run_id"], self.status.get(record["id"])


def write_finished(store: Store, tenant: str, n: int) -> list[str]:
    """`n` finished batches of `tenant` as the service and the pipeline leave them: the service's record
    (closed) and the pipeline's batch.json. Their ids."""
    ids = []
    for i in range(n):
        batch_id = f"batch_past{i:06d}"
        output_uri = storage.join(store.output_root, "2026-01-01", batch_id)
        store.save_batch({"id": batch_id, "tenant": tenant, "input_file_id": "file-past", "input_uri": "/nonexistent",
                          "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {},
                          "priority": 0, "created_at": 1767225600 + i, "expires_at": 1767312000 + i,
                          "date": "2026-01-01", "output_uri": output_uri, "run_id": f"run-{i}", "open": False})
        storage.write_json(storage.join(output_uri, "batch.json"), {
            "id": batch_id, "status": "completed", "model": "m",
            "request_counts": {"total": 1, "completed": 1, "failed": 0},
            "usage": {"input_tokens": 5, "output_tokens": 4}, "metadata": {}})
        ids.append(batch_id)
    return ids


@pytest.fixture
def service(tmp_path: Path) -> Any:
    from batch_pipeline.service.operations import Service

    return Service(Store(str(tmp_path / "out")), {"k" * 16: TENANT}, "http://127.0.0.1:9", max_in_flight=3,
                   _dagster=RunsStandIn())


def test_create_reads_only_the_open_batches_however_long_the_history(service, monkeypatch):
    store = service.store
    source = service.create_file(TENANT, "one.jsonl", "batch", LINE)
    reads: list[str] = []
    real = storage.read_json
    monkeypatch.setattr(storage, "read_json", lambda uri: (reads.append(uri), real(uri))[1])

    def create() -> tuple[str, list[str], set[str], int]:
        """(the new batch's id, the JSON files create read, the batches they belong to, batch records read)."""
        reads.clear()
        records = store.reads
        batch_id = service.create_batch(TENANT, {"input_file_id": source["id"], "endpoint": "/v1/chat/completions"})["id"]
        return batch_id, list(reads), {m for uri in reads for m in BATCH_IDS.findall(uri)}, store.reads - records

    first, files, touched, records = create()
    assert touched == {first} and records == 0  # no history: the upload's record and its own (absent) results
    alone = len(files)
    past = write_finished(store, TENANT, 500)
    second, files, touched, records = create()
    # The one open batch (first: its record, its batch.json and validation.json, absent) and the new
    # one's; none of the 500 finished ones.
    assert touched == {first, second} and not touched & set(past) and records == 1, (touched, records)
    assert len(files) == alone + 3, files
    # Once the first is seen finished it leaves the index: the next create reads only the second.
    service.dagster.status[first] = "CANCELED"
    assert service.get_batch(TENANT, first) and service.batch_object(store.batch(TENANT, first))["status"] == "cancelled"
    assert [r["id"] for r in store.open_batches(TENANT)] == [second]
    third, files, touched, records = create()
    assert touched == {second, third} and records == 1
    # Reading a finished batch again writes nothing (its record says it is closed).
    writes: list[str] = []
    monkeypatch.setattr(storage, "write_json", lambda uri, data: writes.append(uri))
    service.batch_object(store.batch(TENANT, first))
    assert writes == []


def test_the_limit_counts_open_batches(service):
    source = service.create_file(TENANT, "one.jsonl", "batch", LINE)
    write_finished(service.store, TENANT, 20)
    made = [service.create_batch(TENANT, {"input_file_id": source["id"], "endpoint": "/v1/chat/completions"})["id"]
            for _ in range(3)]  # max_in_flight=3: the 20 finished ones do not count
    from batch_pipeline.service.errors import ApiError

    with pytest.raises(ApiError, match="too many batches in flight") as refused:
        service.create_batch(TENANT, {"input_file_id": source["id"], "endpoint": "/v1/chat/completions"})
    assert refused.value.status == 429
    service.dagster.status[made[0]] = "FAILURE"
    service.create_batch(TENANT, {"input_file_id": source["id"], "endpoint": "/v1/chat/completions"})


def test_a_store_kept_before_the_open_index_is_indexed_once(tmp_path):
    from batch_pipeline.service.app import _seen_finished

    store = Store(str(tmp_path))
    past = write_finished(store, TENANT, 3)
    for batch_id in past:  # written by a service without the index: no `open` mark
        record = store.batch(TENANT, batch_id)
        record.pop("open")
        store.save_batch(record)
    still = {**store.batch(TENANT, past[0]), "id": "batch_open1", "output_uri": str(tmp_path / "none")}
    store.save_batch(still)  # no batch.json: not known to be over
    assert store.index_open_batches(_seen_finished) == 1
    assert [r["id"] for r in store.open_batches(TENANT)] == ["batch_open1"] and store.open_batches("team-b") == []
    before = store.reads
    assert store.index_open_batches(_seen_finished) == 0 and store.reads == before  # once per store
    store.close_batch(store.batch(TENANT, "batch_open1"))
    assert store.open_batches(TENANT) == [] and store.batch(TENANT, "batch_open1")["open"] is False

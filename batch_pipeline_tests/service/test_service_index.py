"""The Batch API's indexes: of open batches (what create reads for the per-tenant limit check) and
of every batch in creation order (what a list and /metrics read).

Covered: with a tenant's history of 500 finished batches, create reads the tenant's open batches
only (reads counted through storage: every JSON read, service records and the pipeline's files),
the same as with no history; a batch seen finished leaves the index, and reading it again writes
nothing; a store kept before the index existed is indexed once, and only its batches not known to
be over. A list page reads that page's records only, with 500 batches in the history as with none;
pages with `after` walk every batch once, newest first, also batches created by 8 threads at once
and across a new Store over the same folder (a restart); records written before the listing index
(or by an older replica) are listed after the start's `index_listing`, and by the first list of a
Store no service indexed; a listing marker whose record was never written is skipped. A second
/metrics scrape reads only the batches not yet seen finished. A record read and written again keeps
the fields a newer replica added and still lacks the ones never set. The service is the real `Service`
over a real local store; the Dagster web server is a stand-in answering submit and run status (what
it answers does not change what the store reads: a run query is not a storage read). The service
over a real `dagster dev`: test_batch_api.py's limit and list tests.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.io import storage
from batch_pipeline.service.batches.protocol import BatchRecord
from batch_pipeline.service.store import Store

TENANT = "team-a"
LINE = b'{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
BATCH_IDS = re.compile(r"batch_(?:[0-9a-f]{24}|past[0-9]{6})")


class RunsStandIn:
    """The Dagster web server's answers the service needs here: a run id at submit, its status after."""

    def __init__(self) -> None:
        self.status: dict[str, str] = {}

    def submit(self, record: BatchRecord) -> str:
        record.turn = 0
        self.status[record.id] = "QUEUED"
        return f"run-{record.id}"

    def current_run(self, record: BatchRecord) -> tuple[str, str | None]:
        return record.run_id, self.status.get(record.id)

    def failure_reason(self, run_id: str) -> str:
        return "its step failed. Not retried: the Dagster instance does not retry runs (run_retries off)"


def write_finished(store: Store, tenant: str, n: int) -> list[str]:
    """`n` finished batches of `tenant` as the service and the pipeline leave them: the service's record
    (closed) and the pipeline's batch.json. Their ids."""
    ids = []
    for i in range(n):
        batch_id = f"batch_past{i:06d}"
        output_uri = storage.join(store.output_root, "2026-01-01", batch_id)
        store.save_batch(BatchRecord(id=batch_id, tenant=tenant, input_file_id="file-past", input_uri="/nonexistent",
                                     endpoint="/v1/chat/completions", completion_window="24h", metadata={},
                                     priority=0, created_at=1767225600 + i, expires_at=1767312000 + i,
                                     date="2026-01-01", output_uri=output_uri, run_id=f"run-{i}", open=False))
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
        batch_id = service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
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
    assert service.get_batch(TENANT, first) and service.batch_object(store.batch(TENANT, first)).status == "cancelled"
    assert [r.id for r in store.open_batches(TENANT)] == [second]
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
    made = [service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
            for _ in range(3)]  # max_in_flight=3: the 20 finished ones do not count
    from batch_pipeline.service.errors import ApiError

    with pytest.raises(ApiError, match="too many batches in flight") as refused:
        service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"})
    assert refused.value.status == 429
    service.dagster.status[made[0]] = "FAILURE"
    service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"})


def test_a_store_kept_before_the_open_index_is_indexed_once(tmp_path):
    from batch_pipeline.service.app import _seen_finished

    store = Store(str(tmp_path))
    past = write_finished(store, TENANT, 3)
    for batch_id in past:  # written by a service without the index: no `open` mark
        record = store.batch(TENANT, batch_id)
        record.open = None
        store.save_batch(record)
    still = store.batch(TENANT, past[0]).model_copy(update={"id": "batch_open1", "output_uri": str(tmp_path / "none")})
    store.save_batch(still)  # no batch.json: not known to be over
    assert store.index_open_batches(_seen_finished) == 1
    assert [r.id for r in store.open_batches(TENANT)] == ["batch_open1"] and store.open_batches("team-b") == []
    before = store.reads
    assert store.index_open_batches(_seen_finished) == 0 and store.reads == before  # once per store
    store.close_batch(store.batch(TENANT, "batch_open1"))
    assert store.open_batches(TENANT) == [] and store.batch(TENANT, "batch_open1").open is False


# ------------------------------------------------------------------------ the listing index


def create_batches(service: Any, n: int) -> list[str]:
    source = service.create_file(TENANT, "one.jsonl", "batch", LINE)
    return [service.create_batch(TENANT, {"input_file_id": source.id, "endpoint": "/v1/chat/completions"}).id
            for _ in range(n)]


def list_all(service: Any, limit: int) -> tuple[list[str], list[int]]:
    """Every id the list pages give, following `after`; the batch records each page read."""
    ids: list[str] = []
    reads: list[int] = []
    after = None
    while True:
        before = service.store.reads
        page, more = service.store.batch_page(TENANT, after, limit)
        reads.append(service.store.reads - before)
        ids += [r.id for r in page]
        if not more:
            return ids, reads
        after = page[-1].id


def newest_first(store: Store) -> list[str]:
    """The tenant's batch ids newest first from every record (the list's order before the index)."""
    records = [r for r in store.all_batches() if r.tenant == TENANT]
    return [r.id for r in sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)]


@pytest.fixture
def unlimited(tmp_path: Path) -> Any:
    from batch_pipeline.service.operations import Service

    return Service(Store(str(tmp_path / "out")), {"k" * 16: TENANT}, "http://127.0.0.1:9", _dagster=RunsStandIn())


def test_a_list_page_reads_its_own_records_however_long_the_history(unlimited, monkeypatch):
    from fastapi.testclient import TestClient

    from batch_pipeline.service.app import create_app

    service, store = unlimited, unlimited.store
    reads: list[str] = []
    real = storage.read_json
    monkeypatch.setattr(storage, "read_json", lambda uri: (reads.append(uri), real(uri))[1])
    client = TestClient(create_app(service))
    auth = {"Authorization": "Bearer " + "k" * 16}

    def listed(**params: Any) -> tuple[dict[str, Any], set[str], int]:
        reads.clear()
        before = store.reads
        body = client.get("/v1/batches", params=params, headers=auth).json()
        return body, {m for uri in reads for m in BATCH_IDS.findall(uri)}, store.reads - before

    create_batches(service, 3)
    created = newest_first(store)  # created in one second: their ids decide the order, as before the index
    body, touched, records = listed(limit=2)
    assert [b["id"] for b in body["data"]] == created[:2] and body["has_more"] is True
    assert touched == set(created[:2]) and records == 2, (touched, records)
    alone = len(reads)
    past = write_finished(store, TENANT, 500)  # as a service before the listing index wrote them: no marker
    assert store.index_listing() == 500  # what `batch-pipeline serve` does when it starts
    body, touched, records = listed(limit=2)
    assert [b["id"] for b in body["data"]] == created[:2] and touched == set(created[:2]) and records == 2
    assert len(reads) == alone, reads
    # A page deep in the history: its 20 batches, read, and the `after` batch's record (its day); none
    # of the other 482.
    body, touched, records = listed(limit=20, after=past[300])
    assert [b["id"] for b in body["data"]] == past[299:279:-1] and body["has_more"] is True
    assert touched == set(past[280:301]) and records == 21
    assert body["first_id"] == past[299] and body["last_id"] == past[280]
    # The last page says so; an unknown `after` is an empty page, as before the index.
    body, _, records = listed(limit=20, after=past[5])
    assert [b["id"] for b in body["data"]] == past[4::-1] and body["has_more"] is False and records == 6
    body, _, records = listed(limit=20, after="batch_nosuch")
    assert body["data"] == [] and body["has_more"] is False and records == 0


def test_pages_walk_every_batch_once_newest_first_across_concurrent_creates_and_a_restart(unlimited):
    service, store = unlimited, unlimited.store
    write_finished(store, TENANT, 40)
    first = create_batches(service, 5)
    made: list[str] = []
    errors: list[BaseException] = []

    def creator() -> None:
        try:
            made.extend(create_batches(service, 4))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=creator) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(made) == 32
    ids, reads = list_all(service, 7)  # the first list of this Store indexes the 40 records without a marker
    assert ids == newest_first(store) and len(ids) == 40 + 5 + 32 and set(first + made) <= set(ids)
    # A restart: a new Store over the same folder lists the same, each page reading at most its own.
    restarted = type(service)(Store(store.output_root), service.keys, service.dagster_url, _dagster=service.dagster)
    assert restarted.store.index_listing() == 0
    ids_again, reads = list_all(restarted, 7)
    assert ids_again == ids and max(reads) == 8  # 7 records and the `after` batch's
    # A record an older replica wrote after this start (no marker) is listed after the next start.
    old = store.batch(TENANT, first[0]).model_copy(update={"id": "batch_olderreplica", "created_at": 4102444800,
                                                          "open": None})  # 2100: newest
    store.save_batch(old)
    assert "batch_olderreplica" not in list_all(restarted, 100)[0]
    assert Store(store.output_root).index_listing() == 1
    assert list_all(restarted, 100)[0][:1] == ["batch_olderreplica"] == newest_first(store)[:1]


def test_a_listing_marker_without_its_record_is_skipped(unlimited):
    service, store = unlimited, unlimited.store
    create_batches(service, 2)
    created = newest_first(store)
    crashed = BatchRecord(id="batch_crashed", tenant=TENANT, created_at=1)  # the markers written, then a crash
    store._list_marker(crashed)
    page, more = store.batch_page(TENANT, None, 2)
    assert [r.id for r in page] == created and more is False
    page, more = store.batch_page(TENANT, None, 1)
    assert [r.id for r in page] == created[:1] and more is True
    assert [r.id for r in store.batch_page(TENANT, created[1], 5)[0]] == []


def test_a_second_metrics_scrape_reads_only_batches_not_seen_finished(unlimited):
    from batch_pipeline.service.app import figures
    from batch_pipeline.service.prometheus import FinishedBatches

    service, store = unlimited, unlimited.store
    write_finished(store, TENANT, 200)
    running = create_batches(service, 3)
    assert store.index_listing() == 200  # as the service's start does
    finished = FinishedBatches()
    service._dagster.queued_runs = lambda: 0  # the queue figure (not a storage read)
    service._dagster.graphql = lambda query, variables=None: {"runsOrError": {"count": 0, "results": []}}

    def batch_lines(page: str) -> list[str]:
        return [line for line in page.splitlines() if line.startswith("batch_pipeline_api_batches{")]

    before = store.reads
    page = figures(service, finished)
    assert store.reads - before == 203 and 'batch_pipeline_api_batches{status="completed"} 200' in page
    before = store.reads
    assert batch_lines(figures(service, finished)) == batch_lines(page)
    assert store.reads - before == 3  # the three still queued: their status can change
    service._dagster.status[running[0]] = "CANCELED"
    page = figures(service, finished)
    assert 'batch_pipeline_api_batches{status="cancelled"} 1' in page
    before = store.reads
    figures(service, finished)
    assert store.reads - before == 2


def test_a_page_lists_only_the_days_it_needs(unlimited, monkeypatch):
    store = unlimited.store
    made = []  # 3 batches a day over 30 days, as an older service wrote them (no markers)
    for day in range(30):
        for k in range(3):
            record = BatchRecord(id=f"batch_day{day:03d}n{k}", tenant=TENANT, created_at=1767225600 + day * 86400 + k * 60)
            store.save_batch(record)
            made.append(record.id)
    assert store.index_listing() == 90
    expected = made[::-1]
    assert newest_first(store) == expected
    listings: list[str] = []
    real = storage.list_objects
    monkeypatch.setattr(storage, "list_objects",
                        lambda prefix, *args, **kwargs: (listings.append(prefix), real(prefix, *args, **kwargs))[1])
    page, more = store.batch_page(TENANT, None, 5)
    assert [r.id for r in page] == expected[:5] and more is True
    assert len(listings) == 3  # the tenant's days, the newest day (3 batches) and the day before (2 and 1 more)
    listings.clear()
    # From the middle: the rest of the `after` batch's day (1), the day before (3), and the next day's
    # first name for has_more; the 13 newer days and the 14 older ones are not listed.
    page, more = store.batch_page(TENANT, expected[40], 4)
    assert [r.id for r in page] == expected[41:45] and more is True and len(listings) == 4
    ids, _ = list_all(unlimited, 7)
    assert ids == expected


def test_markers_of_the_first_layout_without_days_are_indexed_again(unlimited):
    store = unlimited.store
    record = BatchRecord(id="batch_firstlayout", tenant=TENANT, created_at=1767225600)
    store.save_batch(record)
    # As 84a428a wrote it: listed/<tenant hash>/<created_at>-<id>.json, no day folder.
    storage.write_bytes(storage.join(store._listed_folder(TENANT), "001767225600-batch_firstlayout.json"), b"")
    assert store.index_listing() == 1
    assert store.batch_ids() == ["batch_firstlayout"]
    assert [r.id for r in store.batch_page(TENANT, None, 5)[0]] == ["batch_firstlayout"]


def test_a_record_keeps_what_it_does_not_know_and_leaves_out_what_was_never_set(tmp_path):
    """Records are parsed into their model where they are read: a field of a newer replica survives a
    read and a write, and the fields written only once set stay absent while unset, as older replicas
    reading the same store expect (no `open`: a store kept before the open index)."""
    store = Store(str(tmp_path))
    path = tmp_path / "_batch_api" / "batches" / "batch_newer.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"id": "batch_newer", "tenant": TENANT, "created_at": 1, "run_id": None,
                                "from_a_newer_replica": {"x": 1}}))
    record = store.batch(TENANT, "batch_newer")
    record.cancelling_at = 5
    store.save_batch(record)
    saved = json.loads(path.read_text())
    assert saved["from_a_newer_replica"] == {"x": 1} and saved["cancelling_at"] == 5 and saved["run_id"] is None
    assert not {"open", "turn", "submit_error", "terminate_pending", "run_failure", "model_versions", "expires_at"} & set(saved)
    assert store.batch("team-b", "batch_newer") is None  # another tenant's

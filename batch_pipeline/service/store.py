"""What the Batch API service keeps: files and batches, as JSON records in the results storage.

Records live under `STORAGE_OUTPUT_PATH/_batch_api/` (a local folder or S3), so they survive a
restart of the service, every replica sees the same ones, and nothing but the storage is needed.
An uploaded file's content is stored beside its record; a batch's results are the pipeline's own
files in `STORAGE_OUTPUT_PATH/<date>/<batch id>/`, served as the batch's output and error files.

Batches that may still be unfinished are indexed per tenant (`_batch_api/open/<tenant hash>/<batch
id>`): a marker written when the batch is created and deleted once the service sees it finished, so
the limit check at create reads a tenant's open batches only, however long its history.

Every batch is also listed per tenant in creation order, by day (UTC): an empty marker
`_batch_api/listed/<tenant hash>/<day>/<created_at, 12 digits>-<batch id>.json`, and the day itself
as `_batch_api/listed/<tenant hash>/days/<day>`, both written at create before the record. A page of
`GET /v1/batches` lists the tenant's days, then the days from the newest (or from the day of the
`after` batch, its record read once) until the page is full, and reads the page's records: its cost
follows the page and the busiest day it touches, not the history. Each marker is its own object, so
concurrent creates (several replicas) never overwrite one another's; a marker whose record is missing
(a crash between the writes) is skipped. Records written before this index existed get their markers
when a service starts (`index_listing`: one listing of the records, one of the markers, a read of each
record without a marker; run again at each start, so records an older replica wrote meanwhile are
picked up too), or on the first list of a store no service has indexed in this process.

Expiry (files' `expires_after`, batches' `output_expires_after`) is swept lazily: a file past its
`expires_at` has its content deleted from storage the first time it is read, listed or counted, and
is from then on unknown (404). Nothing runs in the background, so an expired file nobody asks for
stays in storage until then.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from batch_pipeline.io import storage
from batch_pipeline.service.batches.protocol import BatchRecord
from batch_pipeline.service.files.protocol import FileRecord

FOLDER = "_batch_api"
# A batch's result files are files of the API too, with ids derived from the batch's.
RESULT_FILES = {"output": "output.jsonl", "errors": "errors.jsonl"}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# Written once the open-batch index covers every record (a store kept before the index had none).
INDEXED_MARKER = "INDEXED"
# `<created_at>-<batch id>.json`: the creation time zero-padded, so names sort as (created_at, id).
LISTED_TIME_DIGITS = 12
LISTED_DAYS = "days"  # listed/<tenant hash>/days/<YYYY-MM-DD>: the days a tenant created batches on


@dataclass
class Store:
    output_root: str  # STORAGE_OUTPUT_PATH
    reads: int = field(default=0, compare=False)  # batch records read so far (what a call costs, in tests)
    _listing_checked: bool = field(default=False, compare=False, repr=False)  # index_listing ran in this process
    # count_files' view of each file record: uri -> (etag, None when deleted, else expires_at or 0).
    _file_states: dict[str, tuple[str, float | None]] = field(default_factory=dict, compare=False, repr=False)

    def _uri(self, *parts: str) -> str:
        return storage.join(self.output_root, FOLDER, *parts)

    # The storage boundary: a record is parsed into its model here, once, where it is read.

    def _read_batch(self, uri: str) -> BatchRecord:
        self.reads += 1
        return BatchRecord.model_validate(storage.read_json(uri))

    @staticmethod
    def _read_file(uri: str) -> FileRecord:
        return FileRecord.model_validate(storage.read_json(uri))

    # -- files -------------------------------------------------------------------------------

    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes,
                 expires_after: int | None = None) -> FileRecord:
        file_id = new_id("file-")
        content = self._uri("files", f"{file_id}.jsonl")
        storage.write_bytes(content, data)
        now = int(time.time())
        record = FileRecord(id=file_id, bytes=len(data), created_at=now,
                            expires_at=now + expires_after if expires_after else None,
                            filename=filename, purpose=purpose, tenant=tenant, uri=content)
        self._save_file(record)
        return record

    def _save_file(self, record: FileRecord) -> None:
        storage.write_json(self._uri("files", f"{record.id}.json"), record.stored())

    def file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The tenant's file (an upload, or a batch's output or error file); None when it is not theirs."""
        for kind, name in RESULT_FILES.items():
            suffix = f"-{kind}"
            if file_id.startswith("file-batch_") and file_id.endswith(suffix):
                batch = self.batch(tenant, file_id[len("file-"):-len(suffix)])
                if batch is None:
                    return None
                uri = storage.join(batch.output_uri, name)
                try:
                    info = storage.describe(uri)
                except FileNotFoundError:  # the batch has not written its results yet, or they expired
                    return None
                # Created when the pipeline wrote it; `output_expires_after` counts from then (OpenAI's anchor).
                created = int(info.modified)
                seconds = batch.output_expires_after
                expires_at = created + seconds if seconds else None
                if expires_at is not None and time.time() >= expires_at:
                    storage.delete(uri)
                    return None
                return FileRecord(id=file_id, bytes=info.size, created_at=created, expires_at=expires_at,
                                  filename=name, purpose="batch_output", tenant=tenant, uri=uri)
        path = self._uri("files", f"{file_id}.json")
        if not _safe_id(file_id) or not storage.exists(path):
            return None
        record = self._read_file(path)
        return record if record.tenant == tenant and self._live(record) else None

    def files(self, tenant: str) -> list[FileRecord]:
        records = [self._read_file(o.uri) for o in storage.list_objects(self._uri("files") + "/", suffix=".json")]
        return sorted((r for r in records if r.tenant == tenant and self._live(r)),
                      key=lambda r: r.created_at, reverse=True)

    def _live(self, record: FileRecord) -> bool:
        """Not deleted and not expired; an expired upload's content is deleted here (the lazy sweep)."""
        if record.deleted:
            return False
        if record.expires_at and time.time() >= record.expires_at:
            self._save_file(record.model_copy(update={"deleted": True, "expired": True}))
            storage.delete(record.uri)
            return False
        return True

    def delete_file(self, record: FileRecord) -> None:
        self._save_file(record.model_copy(update={"deleted": True}))
        storage.delete(record.uri)

    # -- batches -----------------------------------------------------------------------------

    def save_batch(self, record: BatchRecord) -> None:
        storage.write_json(self._uri("batches", f"{record.id}.json"), record.stored())

    def add_batch(self, record: BatchRecord) -> None:
        """A new batch: its marker in its tenant's listing, its record (`open`), and its marker among its
        tenant's open batches. The listing marker first: a crash after it leaves a marker list skips,
        never a record list cannot find."""
        self._list_marker(record)
        record.open = True
        self.save_batch(record)
        storage.write_json(self._open_uri(record.tenant, record.id), {"id": record.id})

    def close_batch(self, record: BatchRecord) -> None:
        """The batch is finished: out of the open index. Only a record marked `open` has anything to
        close, so reading a finished batch again writes nothing."""
        if record.open:
            storage.delete(self._open_uri(record.tenant, record.id))
            record.open = False
            self.save_batch(record)

    def reopen_batch(self, record: BatchRecord) -> None:
        """A batch seen finished that is not over after all (its failed run was retried after the
        service had given up waiting: dagster_client.retry_outcome): back among its tenant's open batches."""
        if record.open is False:
            record.open = True
            record.run_failure = None
            self.save_batch(record)
            storage.write_json(self._open_uri(record.tenant, record.id), {"id": record.id})

    def open_batches(self, tenant: str) -> list[BatchRecord]:
        """The tenant's batches not yet seen finished: one listing and a record read each."""
        found = []
        for marker in storage.list_objects(self._open_folder(tenant) + "/", suffix=".json"):
            record = self.batch(tenant, storage.basename(marker.uri).removesuffix(".json"))
            if record is not None:
                found.append(record)
        return found

    def index_open_batches(self, finished: Callable[[BatchRecord], bool]) -> int:
        """Once per store: index the batches of a store kept before the open index existed (those without
        an `open` mark that `finished` does not say are over); the number indexed. A store with the
        index reads nothing."""
        done = self._uri("open", INDEXED_MARKER)
        if storage.exists(done):
            return 0
        indexed = 0
        for record in self.all_batches():
            if record.open is None and not finished(record):
                self.add_batch(record)
                indexed += 1
        storage.write_json(done, {"at": int(time.time())})
        return indexed

    def _open_folder(self, tenant: str) -> str:
        return self._uri("open", _tenant_folder(tenant))

    def _open_uri(self, tenant: str, batch_id: str) -> str:
        return storage.join(self._open_folder(tenant), f"{batch_id}.json")

    def batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        path = self._uri("batches", f"{batch_id}.json")
        if not _safe_id(batch_id) or not storage.exists(path):
            return None
        record = self._read_batch(path)
        return record if record.tenant == tenant else None

    # -- the listing: every batch of a tenant, newest first ------------------------------------

    def _listed_folder(self, tenant: str) -> str:
        return self._uri("listed", _tenant_folder(tenant))

    def _listed_uri(self, record: BatchRecord) -> str:
        return storage.join(self._listed_folder(record.tenant), _day(record.created_at),
                            _listed_name(record.created_at, record.id))

    def _list_marker(self, record: BatchRecord) -> None:
        """The batch's markers in its tenant's listing: its day (written once), then the batch."""
        day = storage.join(self._listed_folder(record.tenant), LISTED_DAYS, _day(record.created_at))
        if not storage.exists(day):  # two creates of a new day both write it: the same empty object
            storage.write_bytes(day, b"")
        storage.write_bytes(self._listed_uri(record), b"")

    def _listed_names(self, folder: str, suffix: str | None = None) -> list[str]:
        """Names in one folder of the listing, newest first."""
        return sorted((storage.basename(o.uri) for o in storage.list_objects(folder + "/", suffix=suffix,
                                                                             recursive=False)), reverse=True)

    def _ids_after(self, tenant: str, after: str | None) -> Iterator[str]:
        """The tenant's batch ids newest first (created_at, then id, descending), from just after the
        batch `after` (nothing when it is not the tenant's): the days' names, then each day's names,
        listed only as far as the caller reads."""
        if not self._listing_checked:
            self.index_listing()
        folder = self._listed_folder(tenant)
        days = self._listed_names(storage.join(folder, LISTED_DAYS))
        start = None
        if after:
            record = self.batch(tenant, after)
            if record is None:
                return
            start = _listed_name(record.created_at, record.id)
            days = [d for d in days if d <= _day(record.created_at)]
        for day in days:
            for name in self._listed_names(storage.join(folder, day), suffix=".json"):
                if start is None or name < start:
                    yield name[LISTED_TIME_DIGITS + 1:-len(".json")]

    def batch_page(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """(up to `limit` of the tenant's batch records after the batch `after`, newest first; whether
        more follow): the listing's names as far as the page needs, then the page's records only. An
        unknown `after` gives an empty page (as before the index)."""
        ids = self._ids_after(tenant, after)
        page: list[BatchRecord] = []
        for batch_id in ids:
            if len(page) == limit:
                # More follow when a later marker has its record: the next one, but for a crashed create's.
                more = storage.exists(self._uri("batches", f"{batch_id}.json")) or any(
                    storage.exists(self._uri("batches", f"{later}.json")) for later in ids)
                return page, more
            record = self.batch(tenant, batch_id)
            if record is not None:  # a marker without its record (a create that crashed): skipped
                page.append(record)
        return page, False

    def index_listing(self) -> int:
        """List the records that have no listing marker (written before the listing index existed, or by
        an older replica since): one listing of the records, one of the markers, and a read of each
        record without one; the number indexed. Run when a service starts and on the first list of a
        Store; idempotent (a marker's name follows from its record), so replicas may run it together."""
        listed = set(self._marked_ids())
        missing = [o.uri for o in storage.list_objects(self._uri("batches") + "/", suffix=".json", recursive=False)
                   if storage.basename(o.uri)[:-len(".json")] not in listed]

        def index(uri: str) -> int:
            try:
                record = self._read_batch(uri)
            except FileNotFoundError:
                return 0
            self._list_marker(record)
            return 1

        # A one-off of a whole store is a read and a write per record: overlapped (S3 round trips, fsyncs).
        with ThreadPoolExecutor(max_workers=8) as pool:
            indexed = sum(pool.map(index, missing))
        self._listing_checked = True
        return indexed

    def batch_ids(self) -> list[str]:
        """Every batch id of every tenant, from the listing index (no record read)."""
        if not self._listing_checked:
            self.index_listing()
        return self._marked_ids()

    def _marked_ids(self) -> list[str]:
        """The ids of every batch marker in a day folder (`listed/<tenant hash>/<day>/`: markers of
        the first layout, without days, count as none), each once."""
        ids: dict[str, None] = {}
        for o in storage.list_objects(self._uri("listed") + "/", suffix=".json"):
            parent = storage.basename(o.uri[:-len(storage.basename(o.uri)) - 1])
            if _DAY.fullmatch(parent):
                ids[storage.basename(o.uri)[LISTED_TIME_DIGITS + 1:-len(".json")]] = None
        return list(ids)

    def batch_by_id(self, batch_id: str) -> BatchRecord | None:
        """Any tenant's batch record (the service's own figures); None when there is none."""
        path = self._uri("batches", f"{batch_id}.json")
        if not _safe_id(batch_id):
            return None
        try:
            return self._read_batch(path)
        except FileNotFoundError:
            return None

    def all_batches(self) -> list[BatchRecord]:
        """Every tenant's batch records, each read (`batch-pipeline usage`, the one-off open index)."""
        return [self._read_batch(o.uri) for o in storage.list_objects(self._uri("batches") + "/", suffix=".json")]

    def count_files(self) -> int:
        """Uploaded files kept (for /metrics): one listing, and a record read only when it is new or
        changed since this process last counted (its etag from the listing); one past its `expires_at`
        is swept as a read would."""
        count, now, states = 0, time.time(), {}
        for o in storage.list_objects(self._uri("files") + "/", suffix=".json"):
            state = self._file_states.get(o.uri)
            if state is None or state[0] != o.etag:
                record = self._read_file(o.uri)
                state = (o.etag, None if record.deleted else float(record.expires_at or 0))
                if state[1] and now >= state[1]:
                    self._live(record)  # expired: its content deleted, its record marked (a new etag)
                    continue
            states[o.uri] = state
            if state[1] is not None and (not state[1] or now < state[1]):
                count += 1
        self._file_states = states
        return count


def _tenant_folder(tenant: str) -> str:
    """Tenants are the operator's free text: hashed into a safe folder name."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def _day(created_at: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(int(created_at)))


def _listed_name(created_at: int, batch_id: str) -> str:
    return f"{int(created_at):0{LISTED_TIME_DIGITS}d}-{batch_id}.json"


def _safe_id(value: str) -> bool:
    return bool(value) and all(c.isalnum() or c in "-_" for c in value)

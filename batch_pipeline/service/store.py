"""What the Batch API service keeps: files and batches, as JSON records in the results storage.

Records live under `STORAGE_OUTPUT_PATH/_batch_api/` (a local folder or S3), so they survive a
restart of the service, every replica sees the same ones, and nothing but the storage is needed.
An uploaded file's content is stored beside its record; a batch's results are the pipeline's own
files in `STORAGE_OUTPUT_PATH/<date>/<batch id>/`, served as the batch's output and error files.

Batches that may still be unfinished are indexed per tenant (`_batch_api/open/<tenant hash>/<batch
id>`): a marker written when the batch is created and deleted once the service sees it finished, so
the limit check at create reads a tenant's open batches only, however long its history.

Expiry (files' `expires_after`, batches' `output_expires_after`) is swept lazily: a file past its
`expires_at` has its content deleted from storage the first time it is read, listed or counted, and
is from then on unknown (404). Nothing runs in the background, so an expired file nobody asks for
stays in storage until then.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batch_pipeline.io import storage

FOLDER = "_batch_api"
# A batch's result files are files of the API too, with ids derived from the batch's.
RESULT_FILES = {"output": "output.jsonl", "errors": "errors.jsonl"}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# Written once the open-batch index covers every record (a store kept before the index had none).
INDEXED_MARKER = "INDEXED"


@dataclass
class Store:
    output_root: str  # STORAGE_OUTPUT_PATH
    reads: int = field(default=0, compare=False)  # batch records read so far (the limit check's cost, in tests)

    def _uri(self, *parts: str) -> str:
        return storage.join(self.output_root, FOLDER, *parts)

    def _read_batch(self, uri: str) -> dict[str, Any]:
        self.reads += 1
        return storage.read_json(uri)

    # -- files -------------------------------------------------------------------------------

    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes,
                 expires_after: int | None = None) -> dict[str, Any]:
        file_id = new_id("file-")
        content = self._uri("files", f"{file_id}.jsonl")
        storage.write_bytes(content, data)
        now = int(time.time())
        record = {"id": file_id, "object": "file", "bytes": len(data), "created_at": now,
                  "expires_at": now + expires_after if expires_after else None,
                  "filename": filename, "purpose": purpose, "status": "processed", "tenant": tenant, "uri": content}
        storage.write_json(self._uri("files", f"{file_id}.json"), record)
        return record

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        """The tenant's file (an upload, or a batch's output or error file); None when it is not theirs."""
        for kind, name in RESULT_FILES.items():
            suffix = f"-{kind}"
            if file_id.startswith("file-batch_") and file_id.endswith(suffix):
                batch = self.batch(tenant, file_id[len("file-"):-len(suffix)])
                if batch is None:
                    return None
                uri = storage.join(batch["output_uri"], name)
                try:
                    info = storage.describe(uri)
                except FileNotFoundError:  # the batch has not written its results yet, or they expired
                    return None
                # Created when the pipeline wrote it; `output_expires_after` counts from then (OpenAI's anchor).
                created = int(info.modified)
                seconds = batch.get("output_expires_after")
                expires_at = created + seconds if seconds else None
                if expires_at is not None and time.time() >= expires_at:
                    storage.delete(uri)
                    return None
                return {"id": file_id, "object": "file", "bytes": info.size, "created_at": created,
                        "expires_at": expires_at, "filename": name, "purpose": "batch_output", "status": "processed",
                        "tenant": tenant, "uri": uri}
        path = self._uri("files", f"{file_id}.json")
        if not _safe_id(file_id) or not storage.exists(path):
            return None
        record = storage.read_json(path)
        return record if record.get("tenant") == tenant and self._live(record) else None

    def files(self, tenant: str) -> list[dict[str, Any]]:
        records = [storage.read_json(o.uri) for o in storage.list_objects(self._uri("files") + "/", suffix=".json")]
        return sorted((r for r in records if r.get("tenant") == tenant and self._live(r)),
                      key=lambda r: r["created_at"], reverse=True)

    def _live(self, record: dict[str, Any]) -> bool:
        """Not deleted and not expired; an expired upload's content is deleted here (the lazy sweep)."""
        if record.get("deleted"):
            return False
        if record.get("expires_at") and time.time() >= record["expires_at"]:
            storage.write_json(self._uri("files", f"{record['id']}.json"), {**record, "deleted": True, "expired": True})
            storage.delete(record["uri"])
            return False
        return True

    def delete_file(self, record: dict[str, Any]) -> None:
        storage.write_json(self._uri("files", f"{record['id']}.json"), {**record, "deleted": True})
        storage.delete(record["uri"])

    # -- batches -----------------------------------------------------------------------------

    def save_batch(self, record: dict[str, Any]) -> None:
        storage.write_json(self._uri("batches", f"{record['id']}.json"), record)

    def add_batch(self, record: dict[str, Any]) -> None:
        """A new batch: its record (`open`), and its marker among its tenant's open batches."""
        record["open"] = True
        self.save_batch(record)
        storage.write_json(self._open_uri(record["tenant"], record["id"]), {"id": record["id"]})

    def close_batch(self, record: dict[str, Any]) -> None:
        """The batch is finished: out of the open index. Only a record marked `open` has anything to
        close, so reading a finished batch again writes nothing."""
        if record.get("open"):
            storage.delete(self._open_uri(record["tenant"], record["id"]))
            record["open"] = False
            self.save_batch(record)

    def open_batches(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's batches not yet seen finished: one listing and a record read each."""
        found = []
        for marker in storage.list_objects(self._open_folder(tenant) + "/", suffix=".json"):
            record = self.batch(tenant, storage.basename(marker.uri).removesuffix(".json"))
            if record is not None:
                found.append(record)
        return found

    def index_open_batches(self, finished: Callable[[dict[str, Any]], bool]) -> int:
        """Once per store: index the batches of a store kept before the open index existed (those without
        an `open` mark that `finished` does not say are over); the number indexed. A store with the
        index reads nothing."""
        done = self._uri("open", INDEXED_MARKER)
        if storage.exists(done):
            return 0
        indexed = 0
        for record in self.all_batches():
            if "open" not in record and not finished(record):
                self.add_batch(record)
                indexed += 1
        storage.write_json(done, {"at": int(time.time())})
        return indexed

    def _open_folder(self, tenant: str) -> str:
        # Tenants are the operator's free text: hashed into a safe folder name.
        return self._uri("open", hashlib.sha256(tenant.encode()).hexdigest()[:32])

    def _open_uri(self, tenant: str, batch_id: str) -> str:
        return storage.join(self._open_folder(tenant), f"{batch_id}.json")

    def batch(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        path = self._uri("batches", f"{batch_id}.json")
        if not _safe_id(batch_id) or not storage.exists(path):
            return None
        record = self._read_batch(path)
        return record if record.get("tenant") == tenant else None

    def batches(self, tenant: str) -> list[dict[str, Any]]:
        records = [self._read_batch(o.uri) for o in storage.list_objects(self._uri("batches") + "/", suffix=".json")]
        return sorted((r for r in records if r.get("tenant") == tenant), key=lambda r: (r["created_at"], r["id"]),
                      reverse=True)

    def all_batches(self) -> list[dict[str, Any]]:
        """Every tenant's batch records (for the service's own figures)."""
        return [self._read_batch(o.uri) for o in storage.list_objects(self._uri("batches") + "/", suffix=".json")]

    def count_files(self) -> int:
        return sum(1 for o in storage.list_objects(self._uri("files") + "/", suffix=".json")
                   if self._live(storage.read_json(o.uri)))


def _safe_id(value: str) -> bool:
    return bool(value) and all(c.isalnum() or c in "-_" for c in value)

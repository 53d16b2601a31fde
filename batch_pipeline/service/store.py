"""What the Batch API service keeps: files and batches, as JSON records in the results storage.

Records live under `STORAGE_OUTPUT_PATH/_batch_api/` (a local folder or S3), so they survive a
restart of the service, every replica sees the same ones, and nothing but the storage is needed.
An uploaded file's content is stored beside its record; a batch's results are the pipeline's own
files in `STORAGE_OUTPUT_PATH/<date>/<batch id>/`, served as the batch's output and error files.

Expiry (files' `expires_after`, batches' `output_expires_after`) is swept lazily: a file past its
`expires_at` has its content deleted from storage the first time it is read, listed or counted, and
is from then on unknown (404). Nothing runs in the background, so an expired file nobody asks for
stays in storage until then.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from batch_pipeline.io import storage

FOLDER = "_batch_api"
# A batch's result files are files of the API too, with ids derived from the batch's.
RESULT_FILES = {"output": "output.jsonl", "errors": "errors.jsonl"}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class Store:
    output_root: str  # STORAGE_OUTPUT_PATH

    def _uri(self, *parts: str) -> str:
        return storage.join(self.output_root, FOLDER, *parts)

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

    def batch(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        path = self._uri("batches", f"{batch_id}.json")
        if not _safe_id(batch_id) or not storage.exists(path):
            return None
        record = storage.read_json(path)
        return record if record.get("tenant") == tenant else None

    def batches(self, tenant: str) -> list[dict[str, Any]]:
        records = [storage.read_json(o.uri) for o in storage.list_objects(self._uri("batches") + "/", suffix=".json")]
        return sorted((r for r in records if r.get("tenant") == tenant), key=lambda r: (r["created_at"], r["id"]),
                      reverse=True)


    def all_batches(self) -> list[dict[str, Any]]:
        """Every tenant's batch records (for the service's own figures)."""
        return [storage.read_json(o.uri) for o in storage.list_objects(self._uri("batches") + "/", suffix=".json")]

    def count_files(self) -> int:
        return sum(1 for o in storage.list_objects(self._uri("files") + "/", suffix=".json")
                   if self._live(storage.read_json(o.uri)))


def _safe_id(value: str) -> bool:
    return bool(value) and all(c.isalnum() or c in "-_" for c in value)

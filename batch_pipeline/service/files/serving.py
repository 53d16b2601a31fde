"""What each Files call does over the store (no HTTP here): upload (limits, expiry), read."""

from __future__ import annotations

import json
import logging
from typing import Any

from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.files.protocol import FileRecord
from batch_pipeline.service.api_settings import MAX_EXPIRY_SECONDS
from batch_pipeline.service.store import Store

log = logging.getLogger("batch_pipeline.service")


class FileServing:
    """The Files calls of `operations.Service`, which holds the store and the limits named here."""

    store: Store
    max_file_bytes: int
    max_file_requests: int
    min_expiry: int

    def create_file(self, tenant: str, filename: str, purpose: str, data: bytes,
                    expires_after: dict[str, Any] | None = None) -> FileRecord:
        seconds = self.expiry_seconds(expires_after, "expires_after")
        if purpose != "batch":
            raise ApiError(400, f"purpose {purpose!r} is not served here: only 'batch'", param="purpose")
        if len(data) > self.max_file_bytes:
            raise ApiError(400, f"the file is {len(data)} bytes, over the limit of {self.max_file_bytes}", param="file")
        lines = [line for line in data.splitlines() if line.strip()]
        if len(lines) > self.max_file_requests:
            raise ApiError(400, f"the file has {len(lines)} requests, over the limit of {self.max_file_requests}",
                           param="file")
        if not lines or not any(_json_object(line) for line in lines[:100]):
            raise ApiError(400, "the file is not JSONL: none of its first lines is a JSON object (one request per line)",
                           param="file")
        record = self.store.add_file(tenant, filename, purpose, data, expires_after=seconds)
        log.info("file %s: %d bytes, %d lines, tenant %s", record.id, len(data), len(lines), tenant)
        return record

    def get_file(self, tenant: str, file_id: str) -> FileRecord:
        record = self.store.file(tenant, file_id)
        if record is None:
            raise ApiError(404, f"no file {file_id!r}", param="file_id", code="not_found")
        return record

    def expiry_seconds(self, policy: Any, param: str) -> int | None:
        """Seconds of an `{"anchor": "created_at", "seconds": N}` expiry policy (None: none given)."""
        if policy is None:
            return None
        if not isinstance(policy, dict):
            raise ApiError(400, f"{param}: an object {{anchor, seconds}}", param=param)
        if policy.get("anchor") != "created_at":
            raise ApiError(400, f"{param}.anchor {policy.get('anchor')!r}: only 'created_at'", param=f"{param}.anchor")
        seconds = policy.get("seconds")
        try:
            seconds = int(seconds) if not isinstance(seconds, (bool, float)) else None
        except (TypeError, ValueError):
            seconds = None
        if seconds is None or not self.min_expiry <= seconds <= MAX_EXPIRY_SECONDS:
            raise ApiError(400, f"{param}.seconds {policy.get('seconds')!r}: a whole number of seconds from "
                                f"{self.min_expiry} to {MAX_EXPIRY_SECONDS}", param=f"{param}.seconds")
        return seconds


def _json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False

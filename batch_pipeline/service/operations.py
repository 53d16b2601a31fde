"""The Batch API's service: its settings, who is calling, its Dagster client, and every call (no HTTP
here): the Files calls are `files/serving.py`'s, the Batches calls `batches/serving.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from batch_pipeline.service.audit import AuditLog
from batch_pipeline.service.auth import tenant_of
from batch_pipeline.service.batches.serving import (BATCH_ENDPOINTS, PENDING_FOLDER, SWEEP_SECONDS, TERMINATE_WAIT,
                                                    BatchServing)
from batch_pipeline.service.dagster_client import DagsterClient
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.api_settings import COMPLETION_WINDOWS, MAX_FILE_BYTES, MAX_FILE_REQUESTS, MIN_EXPIRY_SECONDS
from batch_pipeline.service.store import Store


@dataclass
class Service(BatchServing):
    """The Batch API's service: what it was started with, and every call (`BatchServing`, `FileServing`)."""

    store: Store
    keys: dict[str, str]
    dagster_url: str
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_requests: int = MAX_FILE_REQUESTS
    windows: dict[str, int] = field(default_factory=lambda: dict(COMPLETION_WINDOWS))
    max_in_flight: int | None = None  # batches of one tenant not finished; None: no limit
    tenant_limits: dict[str, int | None] = field(default_factory=dict)  # per tenant, over max_in_flight
    min_expiry: int = MIN_EXPIRY_SECONDS
    max_priority: int = 0  # the highest metadata["priority"] of a tenant without its own cap
    tenant_max_priority: dict[str, int] = field(default_factory=dict)  # per tenant, over max_priority
    audit: AuditLog | None = None  # BATCH_API_AUDIT_LOG: a JSON line per call
    _dagster: DagsterClient | None = field(default=None, repr=False)

    # -- identity ----------------------------------------------------------------------------

    def tenant(self, authorization: str | None) -> str:
        return tenant_of(self.keys, authorization)

    def tenant_or_none(self, authorization: str | None) -> str | None:
        """The key's tenant, or None for a missing or wrong key (the audit log's)."""
        try:
            return self.tenant(authorization)
        except ApiError:
            return None

    @property
    def dagster(self) -> DagsterClient:
        if self._dagster is None:
            self._dagster = DagsterClient(self.dagster_url)
        return self._dagster


__all__ = ["Service", "BATCH_ENDPOINTS", "PENDING_FOLDER", "SWEEP_SECONDS", "TERMINATE_WAIT"]

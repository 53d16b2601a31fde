"""OpenAI's Files and Batches API over this pipeline (`batch-pipeline serve`): the openai SDK unchanged.

`client.files.create(purpose="batch")` stores the file; `client.batches.create(...)` submits one
`batch_job` run for it to the Dagster instance through its web server (queued; the daemon launches
it, the `gpu` pool gates it; tagged with the batch id and tenant, so the UI shows API batches beside
scheduled and sensor runs); `client.batches.retrieve` reads the run's status and, once written, the
pipeline's own Batch object; `client.files.content(batch.output_file_id)` is the output.jsonl.

Every /v1 path needs `Authorization: Bearer <key>`; keys are BATCH_API_KEYS (`tenant:key` pairs,
comma-separated) or the lines of BATCH_API_KEYS_FILE. A tenant sees only its own files and batches.
Errors are OpenAI's error bodies, so the SDK raises its own typed errors. Logs carry ids and counts,
never file contents; BATCH_API_AUDIT_LOG adds a JSON line per call (`audit.py`).

This module assembles the app (`create_app`: one router per area, `files/`, `batches/`, `admin/`,
each area's models in its `protocol.py` and what its calls do in its `serving.py`) and builds the
service from the environment (`service_from_env`, an `operations.Service`); the settings are in
`settings.py`, the Dagster client in `dagster_client.py`, a batch's status in `status.py`, the
Prometheus figures in `prometheus.py`.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from batch_pipeline.config.settings import storage_settings_from_env
from batch_pipeline.service.admin import router as admin
from batch_pipeline.service.admin.router import figures, readiness
from batch_pipeline.service.audit import AuditMiddleware, audit_log_from_env
from batch_pipeline.service.batches import router as batches
from batch_pipeline.service.batches.protocol import BatchRecord
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.files import router as files
from batch_pipeline.service.operations import Service
from batch_pipeline.service.api_settings import (completion_windows, dagster_url, file_limits, load_keys, load_limits,
                                             load_priority_caps, min_expiry_seconds)
from batch_pipeline.service.status import TERMINAL_STATUSES, pipeline_batch
from batch_pipeline.service.store import Store

log = logging.getLogger("batch_pipeline.service")


def _seen_finished(record: BatchRecord) -> bool:
    """A record whose batch is over by what storage says (its batch.json, or a run never submitted)."""
    batch = pipeline_batch(record)
    return bool(record.submit_error) or (batch is not None and batch["status"] in TERMINAL_STATUSES)


async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """A request FastAPI could not read (a form field missing, a query parameter not a number) as OpenAI's 400."""
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "form"))
    return JSONResponse(ApiError(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None).body(),
                        status_code=400)


def create_app(service: Service) -> FastAPI:
    """The app: one router per area, OpenAI's error bodies, and the audit middleware, which names each
    call by the route it matches (no docs pages, no OpenAPI schema: the API is OpenAI's)."""
    app = FastAPI(title="batch_pipeline Batch API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _bad_request)  # type: ignore[arg-type]
    for area in (admin.router, files.router, batches.router):
        app.include_router(area(service))
    if service.audit is not None:  # a JSON line per call (BATCH_API_AUDIT_LOG), X-Request-Id on every answer
        app.add_middleware(AuditMiddleware, log=service.audit, tenant_of=service.tenant_or_none, routes=app.routes)
    return app


def service_from_env() -> Service:
    """The service the environment describes; a store kept before the open-batch index is indexed once
    (its records and batch.json files read), so the limit check at create reads only open batches, and
    records without a listing marker get theirs, so a list reads one page."""
    keys = load_keys()
    max_in_flight, tenant_limits = load_limits(set(keys.values()))
    max_priority, tenant_max_priority = load_priority_caps(set(keys.values()))
    max_file_bytes, max_file_requests = file_limits()
    store = Store(storage_settings_from_env().output_path)
    indexed = store.index_open_batches(_seen_finished)
    if indexed:
        log.info("open-batch index: %d batches of an older store indexed", indexed)
    listed = store.index_listing()  # records without a listing marker (an older store, or an older replica's)
    if listed:
        log.info("listing index: %d batches of an older store indexed", listed)
    return Service(
        store=store,
        keys=keys,
        dagster_url=dagster_url(),
        windows=completion_windows(),
        max_in_flight=max_in_flight,
        tenant_limits=tenant_limits,
        min_expiry=min_expiry_seconds(),
        max_priority=max_priority,
        tenant_max_priority=tenant_max_priority,
        max_file_bytes=max_file_bytes,
        max_file_requests=max_file_requests,
        audit=audit_log_from_env(),  # last: a bad setting above refuses the start before the file is opened
    )


__all__ = ["Service", "create_app", "service_from_env", "load_keys", "load_limits", "load_priority_caps",
           "min_expiry_seconds", "completion_windows", "readiness", "figures"]

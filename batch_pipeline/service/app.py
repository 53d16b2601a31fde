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

This module holds the HTTP routes, `create_app` and `service_from_env`; what each call does is in
`operations.py`, the settings in `settings.py`, the Dagster client in `dagster_client.py`, a batch's
status in `status.py`, the Prometheus figures in `metrics.py`.
"""

import logging
from typing import Any

from batch_pipeline.config.settings import storage_settings_from_env
from batch_pipeline.io import storage
from batch_pipeline.service.audit import AuditMiddleware, audit_log_from_env
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.metrics import DateLines, FinishedBatches, prometheus, read_queue, recent_dates
from batch_pipeline.service.operations import Service
from batch_pipeline.service.settings import (completion_windows, dagster_url, file_limits, load_keys, load_limits,
                                             load_priority_caps, min_expiry_seconds)
from batch_pipeline.service.status import TERMINAL_STATUSES, pipeline_batch
from batch_pipeline.service.store import Store

log = logging.getLogger("batch_pipeline.service")


def readiness(service: Service) -> list[str]:
    """What keeps the service from serving: the storage, and the Dagster instance (its web server and
    run storage: a query of its runs), each checked."""
    problems = []
    try:
        storage.list_objects(storage.join(service.store.output_root, "_batch_api", "batches") + "/")
    except Exception as e:  # noqa: BLE001
        problems.append(f"storage {service.store.output_root}: {type(e).__name__}: {str(e)[:200]}")
    try:
        service.dagster.count_queued_runs()
    except Exception as e:  # noqa: BLE001
        problems.append(f"Dagster web server {service.dagster_url}: {type(e).__name__}: {str(e)[:200]}")
    return problems


def figures(service: Service, finished: FinishedBatches | None = None, dates: DateLines | None = None) -> str:
    """/metrics: every tenant's batches (each one's Batch object; the finished ones kept in `finished`
    across scrapes), the files kept, the queued runs and the oldest one's age, the lines of the
    upload sensor's and the schedule's batches of yesterday and today."""
    ids = service.store.batch_ids()
    batches = (finished or FinishedBatches()).batches(service.store, service.batch_object, ids)
    file_lines = {date: (dates or DateLines()).lines(service.store.output_root, date, set(ids))
                  for date in recent_dates()}
    return prometheus(batches, service.store.count_files(), read_queue(service.dagster.graphql), file_lines)


def _seen_finished(record: dict[str, Any]) -> bool:
    """A record whose batch is over by what storage says (its batch.json, or a run never submitted)."""
    batch = pipeline_batch(record)
    return bool(record.get("submit_error")) or (batch is not None and batch["status"] in TERMINAL_STATUSES)


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """A file record as OpenAI's FileObject (without where it is stored or whose it is)."""
    return {k: v for k, v in record.items() if k not in ("tenant", "uri", "deleted", "expired")}


def create_app(service: Service) -> Any:
    from fastapi import FastAPI, File, Form, Header, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="batch_pipeline Batch API", docs_url=None, redoc_url=None)
    if service.audit is not None:  # a JSON line per call (BATCH_API_AUDIT_LOG), X-Request-Id on every answer
        app.add_middleware(AuditMiddleware, log=service.audit, tenant_of=service.tenant_or_none)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "form"))
        return JSONResponse(ApiError(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None).body(),
                            status_code=400)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    def ready() -> JSONResponse:
        problems = readiness(service)
        return JSONResponse({"status": "not ready", "problems": problems} if problems else {"status": "ready"},
                            status_code=503 if problems else 200)

    finished, dates = FinishedBatches(), DateLines()  # what /metrics keeps between scrapes

    @app.get("/metrics")
    def metrics(authorization: str | None = Header(default=None)) -> Response:
        service.tenant(authorization)  # any tenant's key (Prometheus: bearer_token)
        return Response(figures(service, finished, dates), media_type="text/plain; version=0.0.4")

    @app.post("/v1/files")
    async def create_file(file: UploadFile = File(...), purpose: str = Form(...),
                          anchor: str | None = Form(default=None, alias="expires_after[anchor]"),
                          seconds: str | None = Form(default=None, alias="expires_after[seconds]"),
                          authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        expires_after = None if anchor is None and seconds is None else {"anchor": anchor, "seconds": seconds}
        data = await file.read(service.max_file_bytes + 1)
        return _public(service.create_file(tenant, file.filename or "batch.jsonl", purpose, data, expires_after))

    @app.get("/v1/files")
    def list_files(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        data = [_public(r) for r in service.store.files(tenant)]
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return _public(service.get_file(service.tenant(authorization), file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, authorization: str | None = Header(default=None)) -> Response:
        record = service.get_file(service.tenant(authorization), file_id)
        return Response(storage.read_bytes(record["uri"]), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        record = service.get_file(service.tenant(authorization), file_id)
        if record["purpose"] == "batch_output":
            raise ApiError(400, "a batch's output and error files stay as long as the batch", param="file_id")
        service.store.delete_file(record)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body is not a JSON object")
        return service.create_batch(tenant, body)

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: int = 20,
                     authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit: from 1 to 100", param="limit")
        page, more = service.store.batch_page(tenant, after, limit)  # the listing's names, this page's records
        data = [service.batch_object(r) for r in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.batch_object(service.get_batch(service.tenant(authorization), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.cancel_batch(service.tenant(authorization), batch_id)

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
           "min_expiry_seconds", "completion_windows", "readiness"]

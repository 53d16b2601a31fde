"""The service's own routes: `/health` and `/ready` (the probes, unauthenticated, not audited) and
`/metrics` (Prometheus' text format, any tenant's key)."""

from __future__ import annotations

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse, Response

from batch_pipeline.io import storage
from batch_pipeline.service.prometheus import DateLines, FinishedBatches, prometheus, read_queue, recent_dates
from batch_pipeline.service.operations import Service


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


def router(service: Service) -> APIRouter:
    """Each route's name is its action in the audit log (audit.py)."""
    routes = APIRouter()
    finished, dates = FinishedBatches(), DateLines()  # what /metrics keeps between scrapes

    @routes.get("/health", name="health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @routes.get("/ready", name="ready")
    def ready() -> JSONResponse:
        problems = readiness(service)
        return JSONResponse({"status": "not ready", "problems": problems} if problems else {"status": "ready"},
                            status_code=503 if problems else 200)

    @routes.get("/metrics", name="metrics")
    def metrics(authorization: str | None = Header(default=None)) -> Response:
        service.tenant(authorization)  # any tenant's key (Prometheus: bearer_token)
        return Response(figures(service, finished, dates), media_type="text/plain; version=0.0.4")

    return routes

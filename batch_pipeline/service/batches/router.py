"""OpenAI's Batches API: create, list, retrieve, cancel (`client.batches.*`). Each answer is a model
of `protocol.py`, sent as the fields it has set (`BatchObject.body`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Header, Request

from batch_pipeline.service.batches.protocol import BatchList
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.operations import Service


def router(service: Service) -> APIRouter:
    """Each route's name is its action in the audit log (audit.py)."""
    routes = APIRouter(prefix="/v1/batches")

    @routes.post("", name="create")
    async def create_batch(request: Request, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body is not a JSON object")
        return service.create_batch(tenant, body).body()

    @routes.get("", name="list")
    def list_batches(after: str | None = None, limit: int = 20,
                     authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit: from 1 to 100", param="limit")
        page, more = service.store.batch_page(tenant, after, limit)  # the listing's names, this page's records
        data = [service.batch_object(r) for r in page]
        return BatchList(object="list", data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None, has_more=more).body()

    @routes.get("/{batch_id}", name="retrieve")
    def retrieve_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.batch_object(service.get_batch(service.tenant(authorization), batch_id)).body()

    @routes.post("/{batch_id}/cancel", name="cancel")
    def cancel_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.cancel_batch(service.tenant(authorization), batch_id).body()

    return routes

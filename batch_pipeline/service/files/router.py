"""OpenAI's Files API: upload, list, retrieve, content, delete (`client.files.*`). Each answer is a
model of `protocol.py`, sent as its JSON."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, File, Form, Header, UploadFile
from fastapi.responses import Response

from batch_pipeline.io import storage
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.files.protocol import FileDeleted, FileList
from batch_pipeline.service.operations import Service


def router(service: Service) -> APIRouter:
    """Each route's name is its action in the audit log (audit.py)."""
    routes = APIRouter(prefix="/v1/files")

    @routes.post("", name="upload")
    async def create_file(file: UploadFile = File(...), purpose: str = Form(...),
                          anchor: str | None = Form(default=None, alias="expires_after[anchor]"),
                          seconds: str | None = Form(default=None, alias="expires_after[seconds]"),
                          authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        expires_after = None if anchor is None and seconds is None else {"anchor": anchor, "seconds": seconds}
        data = await file.read(service.max_file_bytes + 1)
        return service.create_file(tenant, file.filename or "batch.jsonl", purpose, data, expires_after).public().model_dump()

    @routes.get("", name="list")
    def list_files(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        return FileList(data=[r.public() for r in service.store.files(tenant)]).model_dump()

    @routes.get("/{file_id}", name="retrieve")
    def retrieve_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.get_file(service.tenant(authorization), file_id).public().model_dump()

    @routes.get("/{file_id}/content", name="content")
    def file_content(file_id: str, authorization: str | None = Header(default=None)) -> Response:
        record = service.get_file(service.tenant(authorization), file_id)
        return Response(storage.read_bytes(record.uri), media_type="application/jsonl")

    @routes.delete("/{file_id}", name="delete")
    def delete_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        record = service.get_file(service.tenant(authorization), file_id)
        if record.purpose == "batch_output":
            raise ApiError(400, "a batch's output and error files stay as long as the batch", param="file_id")
        service.store.delete_file(record)
        return FileDeleted(id=file_id).model_dump()

    return routes

"""The Batch API's refusals in OpenAI's error shape, so the openai SDK raises its own typed errors."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A refusal: the HTTP status and OpenAI's `{"error": {message, type, param, code}}` body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

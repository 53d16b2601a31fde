"""The Batch API's audit log: one JSON line per call, to a file or stdout (`BATCH_API_AUDIT_LOG`).

Each line says who (the key's tenant, never the key; null when the key was missing or wrong), what
(method, path, the action, the file or batch id), how it went (status code, response bytes, duration
in ms), from where (the client's address) and a request id (the caller's `X-Request-Id`, or one made
here; returned as the response's `X-Request-Id` either way). Nothing of a request's body, query
string or headers but the request id goes into it, and of an answer only its size and, for an upload
or a batch created, the new object's id: no prompt, answer, file content or key can land there.

`/health` and `/ready` (unauthenticated probes, every few seconds) are not logged; every other path
is. A call's line is written before the last bytes of its answer are sent, in one `write` on a file
opened for appending without buffering, so lines of concurrent requests, and of several replicas
appending to one local file, never interleave.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from starlette.routing import BaseRoute, Match, Route

from batch_pipeline.base.env import read_text
from batch_pipeline.config.settings import ConfigError

VARIABLE = "BATCH_API_AUDIT_LOG"
REQUEST_ID_HEADER = "x-request-id"
# Probes: not API calls of anyone, and a line every few seconds would bury the calls.
UNLOGGED_PATHS = ("/health", "/ready")
# A caller's request id is kept when it is this short and made of these characters; else one is made.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Calls that make an object: its id is read from the (small JSON) answer, as the line's object id.
_CREATES = ("upload", "create")
_ID = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9_-]{1,100})"')
# Every action a line may name (docs/BATCH_API.md lists them): each route of the app is named for its
# action (`name=` in the area's router), so the app's own routes are the one table of what a call is.
ACTIONS = ("upload", "list", "retrieve", "content", "delete", "create", "cancel", "metrics")
OTHER = "other"  # a path the app does not serve, or a method it does not serve there


def action_of(routes: Sequence[BaseRoute], method: str, path: str) -> tuple[str, str | None]:
    """(action, object id named by the path) of a call: the name of the app's route it matches, as the
    app's router matches it, and that route's path parameter; (OTHER, None) for a call no route takes."""
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    for route in routes:
        match, child = route.matches(scope)
        if match == Match.FULL and isinstance(route, Route):
            params = child.get("path_params") or {}
            return route.name, next((str(v) for v in params.values()), None)
    return OTHER, None


class AuditLog:
    """Where audit lines go: a file appended to, or stdout. `write` is safe from any thread."""

    def __init__(self, target: str, stream: BinaryIO | None = None) -> None:
        self.target = target
        self._stream = stream
        self._lock = threading.Lock()

    @classmethod
    def open(cls, value: str) -> "AuditLog":
        """`-` or `stdout`: stdout; otherwise a file path, appended to (ConfigError naming the variable
        when its folder does not exist or it cannot be opened)."""
        if value in ("-", "stdout"):
            return cls("stdout")
        folder = os.path.dirname(os.path.abspath(value))
        if not os.path.isdir(folder):
            raise ConfigError(f"{VARIABLE}={value}: the folder {folder} does not exist")
        try:
            # Unbuffered: each line goes out in one write(2), with O_APPEND at the end of the file.
            stream = open(value, "ab", buffering=0)  # noqa: SIM115 - open for the process's lifetime
        except OSError as e:
            raise ConfigError(f"{VARIABLE}={value}: cannot be opened for appending: {e.strerror}") from None
        return cls(value, stream)

    def write(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry, separators=(",", ":"), ensure_ascii=True) + "\n").encode()
        with self._lock:
            if self._stream is not None:
                self._stream.write(line)
            else:  # stdout, looked up each time (a test harness may swap it); flushed per line
                out = sys.stdout
                out.write(line.decode())
                out.flush()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


def audit_log_from_env(env: dict[str, str] | None = None) -> AuditLog | None:
    """BATCH_API_AUDIT_LOG: unset or empty, no audit log."""
    value = read_text(env, "BATCH_API_AUDIT_LOG")
    return AuditLog.open(value) if value else None


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's X-Request-Id when it is a plain token of up to 128 characters, else a new one."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            given = value.decode("latin-1").strip()
            if _REQUEST_ID.fullmatch(given):
                return given
            break
    return f"req_{uuid.uuid4().hex}"


class AuditMiddleware:
    """ASGI middleware: a line per HTTP call to `log`, and X-Request-Id on every response.

    `tenant_of(authorization header)` names the caller's tenant or returns None (no key, a wrong key);
    `routes` are the app's (`app.routes`), which name each call's action."""

    def __init__(self, app: Any, log: AuditLog, tenant_of: Callable[[str | None], str | None],
                 routes: Sequence[BaseRoute]) -> None:
        self.app, self.log, self.tenant_of, self.routes = app, log, tenant_of, routes

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        wall = time.time()
        headers = list(scope.get("headers") or [])
        rid = request_id(headers)
        path, method = scope.get("path", ""), scope.get("method", "")
        action, object_id = action_of(self.routes, method, path)
        state: dict[str, Any] = {"status": None, "bytes": 0, "head": b"", "logged": path in UNLOGGED_PATHS}

        def log_once() -> None:
            if not state["logged"]:
                state["logged"] = True
                self.log.write(self._entry(scope, headers, wall, start, rid, action, object_id, state))

        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = {**message, "headers": [*(h for h in message.get("headers", [])
                                                    if h[0].lower() != REQUEST_ID_HEADER.encode()),
                                                  (b"x-request-id", rid.encode())]}
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                state["bytes"] += len(body)
                if action in _CREATES and len(state["head"]) < 512:  # enough for the new object's "id"
                    state["head"] += body[:512]
                if not message.get("more_body", False):
                    log_once()  # before the last bytes go: a caller holding the answer finds its line
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        except BaseException:
            if state["status"] is None:
                state["status"] = 500  # what the server's error handler answers
            raise
        finally:
            log_once()  # a call that ended without a complete answer (an error, the client gone)

    def _entry(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]], wall: float, start: float, rid: str,
               action: str, object_id: str | None, state: dict[str, Any]) -> dict[str, Any]:
        status = state["status"]
        if object_id is None and action in _CREATES and status == 200:
            match = _ID.search(state["head"])
            object_id = match.group(1).decode() if match else None
        authorization = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), None)
        try:
            tenant = self.tenant_of(authorization) if authorization else None
        except Exception:  # noqa: BLE001 - a line without a tenant, never a lost line
            tenant = None
        client = scope.get("client")
        return {
            "time": dt.datetime.fromtimestamp(wall, dt.timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "request_id": rid,
            "tenant": tenant,
            "action": action,
            "method": scope.get("method"),
            "path": str(scope.get("path"))[:256],
            "object_id": object_id,
            "status": status,
            "bytes": state["bytes"],
            "duration_ms": round((time.perf_counter() - start) * 1000, 1),
            "client": client[0] if client else None,
        }

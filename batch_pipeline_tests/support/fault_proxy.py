"""A fault-injecting HTTP proxy in front of a real S3 endpoint (moto's server), for storage tests.

Covers: a threaded proxy on 127.0.0.1 and a free port that forwards every request, over real
sockets, to an upstream HTTP endpoint and relays the answer (Content-Length, chunked or
until-close bodies, streamed in 64 KiB pieces so multi-MB GETs never sit in memory), with a
programmable plan of faults::

    proxy.fail_next(1, "slowdown", method="PUT", match="out.jsonl")   # 503 <Code>SlowDown</Code>
    proxy.fail_next(1, "reset", method="GET", after_bytes=1_500_000)  # RST in the middle of a body
    proxy.fail_next(2, "timeout", method="HEAD")                      # silent until the client gives up

Kinds (see KINDS): ``slowdown`` (503 SlowDown), ``503`` (ServiceUnavailable), ``500`` (InternalError),
``403`` (AccessDenied), ``reply`` (any canned status and body), ``reset`` (abort the client socket
with SO_LINGER 0 so the kernel sends RST) and ``timeout`` (hold the connection silent). ``reset``
and ``timeout`` act after the whole request was read and before any response byte. With
``after_request_bytes=N`` they act after only N bytes of the request body were read (an upload cut
off midway); with ``forward=True`` the request is first really forwarded and the answer thrown away
(the write landed, the client never hears so); with ``after_bytes=N`` the response head plus N body
bytes are relayed first (a GET that breaks in the middle of its body).
``match`` is a substring of the request target (path and query, e.g. ``"continuation-token"`` or
``"?uploads"``), ``method`` an HTTP method; a fault applies to the next ``n`` matching requests, and
faults are tried in the order they were planned.

Keep-alive clients (boto3/urllib3 pools) are served request after request on one connection; each
request goes upstream on a fresh connection with ``Connection: close``. ``Expect: 100-continue``
(boto3 sends it for every file-like body, i.e. all managed uploads) is answered by the proxy: an
error fault is sent instead of ``100 Continue`` (as S3 does), anything else gets ``100 Continue``.
Counters (:attr:`FaultProxy.seen`, :meth:`FaultProxy.count`, :meth:`FaultProxy.injected`) let tests
assert that a fault really happened.

Does not speak TLS, does not modify forwarded requests or responses other than hop-by-hop headers,
and does not import moto, Flask or boto3 (the S3 server stays in its own process; see
s3_server.py).
"""

from __future__ import annotations

import itertools
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

KINDS = ("slowdown", "503", "500", "403", "reply", "reset", "timeout")

# kind -> (status, reason, S3 error code, message)
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "503": (503, "Service Unavailable", "ServiceUnavailable", "Service is unable to handle request."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}
_REPLY_KINDS = frozenset(_ERRORS) | {"reply"}
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "expect", "te", "trailer", "upgrade"})
_CHUNK = 64 * 1024
_MAX_HEAD = 256 * 1024
_REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable"}


class _PeerClosed(Exception):
    """The other side closed the connection in the middle of a message."""


@dataclass
class Fault:
    """One planned fault: applies to the next ``remaining`` requests that match."""

    kind: str
    remaining: int
    method: str | None = None
    match: str | None = None
    after_bytes: int | None = None
    forward: bool = False
    after_request_bytes: int | None = None
    hold: float = 30.0
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    injected: int = 0

    def matches(self, method: str, target: str) -> bool:
        if self.method and self.method.upper() != method:
            return False
        return not self.match or self.match in target


@dataclass(frozen=True)
class Seen:
    """One request the proxy received, and what it did with it."""

    method: str
    target: str
    connection: int  # which client connection carried it (keep-alive reuse shows up here)
    fault: str | None  # the kind injected, or None when forwarded untouched
    status: int | None  # status sent to the client (None: no response head reached it)
    upstream: int | None = None  # status the upstream answered (None: not forwarded)
    expect_continue: bool = False  # the request carried Expect: 100-continue


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str:
        name = name.lower()
        return ", ".join(v for k, v in self.headers if k.lower() == name)


class _Stream:
    """A socket with a read buffer: whole heads, exact lengths and chunked bodies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def _fill(self) -> bool:
        data = self.sock.recv(_CHUNK)
        if not data:
            return False
        self._buf += data
        return True

    def read_head(self) -> bytes | None:
        """Bytes up to and including the blank line; None on a clean EOF before any byte."""
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self._buf[: end + 4])
                del self._buf[: end + 4]
                return head
            if len(self._buf) > _MAX_HEAD:
                raise _PeerClosed("message head too large")
            if not self._fill():
                if self._buf.strip():
                    raise _PeerClosed("EOF inside a message head")
                return None

    def readline(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[: end + 2])
                del self._buf[: end + 2]
                return line
            if not self._fill():
                raise _PeerClosed("EOF inside a line")

    def iter_exact(self, n: int) -> Iterator[bytes]:
        while n > 0:
            if not self._buf and not self._fill():
                raise _PeerClosed(f"EOF with {n} bytes still expected")
            piece = bytes(self._buf[: min(n, _CHUNK)])
            del self._buf[: len(piece)]
            n -= len(piece)
            yield piece

    def iter_until_close(self) -> Iterator[bytes]:
        while True:
            if self._buf:
                piece = bytes(self._buf)
                self._buf.clear()
                yield piece
            if not self._fill():
                return

    def iter_chunked(self, raw: bool) -> Iterator[bytes]:
        """A chunked body: the wire bytes (``raw``) or the decoded payload."""
        while True:
            size_line = self.readline()
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if raw:
                yield size_line
            if size == 0:
                while True:  # trailers up to the blank line
                    line = self.readline()
                    if raw:
                        yield line
                    if line == b"\r\n":
                        return
            for piece in self.iter_exact(size):
                yield piece
            crlf = b"".join(self.iter_exact(2))
            if raw:
                yield crlf


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _header(headers: list[tuple[str, str]], name: str) -> str:
    name = name.lower()
    return ", ".join(v for k, v in headers if k.lower() == name)


def _abort(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets RST (ECONNRESET), not an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """Forwards HTTP to ``upstream`` (``http://host:port``) and injects planned faults."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", upstream_timeout: float = 30.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.host = host
        self.port = 0
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._plan: list[Fault] = []
        self._seen: list[Seen] = []
        self._conn_ids = itertools.count(1)
        self._clients: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        thread = threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            clients = list(self._clients)
        for sock in clients:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in list(self._threads):
            thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ plan and counters

    def fail_next(
        self,
        n: int,
        kind: str,
        *,
        method: str | None = None,
        match: str | None = None,
        after_bytes: int | None = None,
        forward: bool = False,
        after_request_bytes: int | None = None,
        hold: float = 30.0,
        status: int = 200,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> Fault:
        """Inject ``kind`` into the next ``n`` requests matching ``method`` and ``match``.

        ``after_request_bytes`` (reset/timeout only): act once that many request body bytes were read.
        ``forward`` (reset/timeout only): forward the request upstream first and drop its answer.
        ``after_bytes`` (reset/timeout only): forward the request and relay the response head plus
        that many body bytes first. ``hold``: how long a timeout stays silent at most (it ends early
        when the client hangs up). ``status``/``body``/``headers``: the canned answer for ``reply``.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {KINDS}")
        modes = (after_bytes is not None) + forward + (after_request_bytes is not None)
        if modes and kind not in ("reset", "timeout"):
            raise ValueError("after_bytes, forward and after_request_bytes only apply to 'reset' and 'timeout'")
        if modes > 1:
            raise ValueError("choose one of after_bytes, forward and after_request_bytes")
        fault = Fault(
            kind, n, method, match, after_bytes, forward, after_request_bytes, hold, status, body, dict(headers or {})
        )
        with self._lock:
            self._plan.append(fault)
        return fault

    def clear(self) -> None:
        """Drop the faults not injected yet (the counters stay)."""
        with self._lock:
            self._plan.clear()

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._plan)

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def count(self, method: str | None = None, match: str | None = None) -> int:
        """Requests received (faulted or not) with that method and target substring."""
        return sum(
            1
            for s in self.seen
            if (method is None or s.method == method.upper()) and (match is None or match in s.target)
        )

    def injected(self, kind: str | None = None, method: str | None = None, match: str | None = None) -> int:
        """Faults injected, optionally only of one kind / for one method / target substring."""
        return sum(
            1
            for s in self.seen
            if s.fault is not None
            and (kind is None or s.fault == kind)
            and (method is None or s.method == method.upper())
            and (match is None or match in s.target)
        )

    @property
    def connections(self) -> int:
        return len({s.connection for s in self.seen})

    def _take(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for fault in self._plan:
                if fault.remaining > 0 and fault.matches(method, target):
                    fault.remaining -= 1
                    fault.injected += 1
                    if fault.remaining == 0:
                        self._plan.remove(fault)
                    return fault
        return None

    def _record(
        self, req: _Request, conn_id: int, fault: Fault | None, status: int | None, upstream: int | None = None
    ) -> None:
        with self._lock:
            expect = req.header("expect").lower() == "100-continue"
            kind = fault.kind if fault else None
            self._seen.append(Seen(req.method, req.target, conn_id, kind, status, upstream, expect))

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.1)
            if not ready:
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._clients.add(sock)
            thread = threading.Thread(target=self._serve, args=(sock, next(self._conn_ids)), daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def _serve(self, sock: socket.socket, conn_id: int) -> None:
        client = _Stream(sock)
        keep = False
        try:
            while not self._stopping.is_set():
                head = client.read_head()
                if head is None:
                    break
                line, headers = _parse_head(head)
                method, target, version = line.split(" ", 2)
                req = _Request(method.upper(), target, version, headers)
                fault = self._take(req.method, req.target)
                keep = self._handle(client, req, conn_id, fault)
                if not keep:
                    break
        except (OSError, _PeerClosed, ValueError):
            keep = False
        finally:
            with self._lock:
                self._clients.discard(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, client: _Stream, req: _Request, conn_id: int, fault: Fault | None) -> bool:
        """Answer one request; returns whether the client connection stays open."""
        expect = req.header("expect").lower() == "100-continue"
        client_close = "close" in req.header("connection").lower() or req.version == "HTTP/1.0"
        if fault is not None and fault.kind in _REPLY_KINDS:
            # Counters are updated before the client can see the answer, so a test that asserts
            # right after its call returns never races the proxy thread.
            self._record(req, conn_id, fault, fault.status if fault.kind == "reply" else _ERRORS[fault.kind][0])
            if expect:  # answer instead of 100 Continue; the client will not send the body
                self._reply(client.sock, req, fault, close=True)
                return False
            for _ in self._request_body(client, req):
                pass
            self._reply(client.sock, req, fault, close=client_close)
            return not client_close
        if expect:
            client.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if fault is not None and fault.after_bytes is None and not fault.forward:  # before forwarding
            budget = fault.after_request_bytes
            for piece in self._request_body(client, req):
                if budget is not None:
                    budget -= len(piece)
                    if budget <= 0:
                        break
            self._record(req, conn_id, fault, None)
            if fault.kind == "timeout":
                self._hold(client.sock, fault.hold)
            _abort(client.sock)
            return False
        return self._forward(client, req, conn_id, fault, client_close)

    def _request_body(self, client: _Stream, req: _Request) -> Iterator[bytes]:
        if "chunked" in req.header("transfer-encoding").lower():
            yield from client.iter_chunked(raw=False)
            return
        length = req.header("content-length")
        if length:
            yield from client.iter_exact(int(length))

    def _reply(self, sock: socket.socket, req: _Request, fault: Fault, close: bool) -> None:
        if fault.kind == "reply":
            status, reason, body = fault.status, _REASONS.get(fault.status, "Fault"), fault.body
            extra = dict(fault.headers)
        else:
            status, reason, code, message = _ERRORS[fault.kind]
            resource = req.target.split("?", 1)[0]
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<Resource>{resource}</Resource><RequestId>FAULTPROXY</RequestId></Error>"
            ).encode()
            extra = {"Content-Type": "application/xml"}
        if req.method == "HEAD":
            body = b""  # HEAD answers carry no body (botocore then uses the status as the code)
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "x-amz-request-id: FAULTPROXY"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        if close:
            lines.append("Connection: close")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)

    def _hold(self, sock: socket.socket, seconds: float) -> None:
        """Stay silent until ``seconds`` pass, the proxy stops or the client hangs up."""
        deadline = time.monotonic() + seconds
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([sock], [], [], min(left, 0.05))
            if ready:
                try:
                    if not sock.recv(_CHUNK):
                        return  # the client gave up and closed
                except OSError:
                    return

    def _forward(self, client: _Stream, req: _Request, conn_id: int, fault: Fault | None, client_close: bool) -> bool:
        chunked_in = "chunked" in req.header("transfer-encoding").lower()
        try:
            up_sock = socket.create_connection(self.upstream, timeout=self.upstream_timeout)
        except OSError:
            for _ in self._request_body(client, req):
                pass
            bad = Fault("reply", 0, status=502, body=b"upstream unreachable")
            self._record(req, conn_id, None, 502)
            self._reply(client.sock, req, bad, close=True)
            return False
        up = _Stream(up_sock)
        try:
            lines = [f"{req.method} {req.target} HTTP/1.1"]
            for name, value in req.headers:
                low = name.lower()
                if low in _HOP_BY_HOP or (chunked_in and low in ("transfer-encoding", "content-length")):
                    continue
                lines.append(f"{name}: {value}")
            if chunked_in:
                body = b"".join(client.iter_chunked(raw=False))
                lines.append(f"Content-Length: {len(body)}")
            lines.append("Connection: close")
            up_sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if chunked_in:
                up_sock.sendall(body)
            else:
                for piece in self._request_body(client, req):
                    up_sock.sendall(piece)

            while True:
                head = up.read_head()
                if head is None:
                    raise _PeerClosed("upstream closed without answering")
                status_line, headers = _parse_head(head)
                status = int(status_line.split(" ", 2)[1])
                if status >= 200:
                    break  # skip interim 1xx answers (we never forward Expect)

            if req.method == "HEAD" or status in (204, 304):
                body_iter: Iterator[bytes] = iter(())
                framed = True
            elif "chunked" in _header(headers, "transfer-encoding").lower():
                body_iter, framed = up.iter_chunked(raw=True), True
            elif _header(headers, "content-length"):
                body_iter, framed = up.iter_exact(int(_header(headers, "content-length"))), True
            else:
                body_iter, framed = up.iter_until_close(), False
            close = client_close or not framed
            out = [status_line] + [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
            if close:
                out.append("Connection: close")
            if fault is not None and fault.after_bytes is None:  # forwarded; the answer is lost
                self._record(req, conn_id, fault, None, status)
                for _ in body_iter:
                    pass
                if fault.kind == "timeout":
                    self._hold(client.sock, fault.hold)
                _abort(client.sock)
                return False
            self._record(req, conn_id, fault, status, status)
            client.sock.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))

            if fault is not None:  # reset/timeout after the head and after_bytes of the body
                budget = fault.after_bytes or 0
                for piece in body_iter:
                    if budget <= 0:
                        break
                    client.sock.sendall(piece[:budget])
                    budget -= len(piece)
                if fault.kind == "timeout":
                    self._hold(client.sock, fault.hold)
                _abort(client.sock)
                return False
            for piece in body_iter:
                client.sock.sendall(piece)
            return not close
        finally:
            up_sock.close()


def start_proxy(upstream: str) -> FaultProxy:
    return FaultProxy(upstream).start()


@pytest.fixture
def fault_proxy(moto_server) -> Iterator[FaultProxy]:  # noqa: ANN001 - MotoS3 from s3_server
    """A FaultProxy in front of the session's moto server (no faults planned yet)."""
    proxy = FaultProxy(moto_server.endpoint_url).start()
    try:
        yield proxy
    finally:
        proxy.stop()


__all__: list[str] = ["KINDS", "Fault", "FaultProxy", "Seen", "fault_proxy", "start_proxy"]

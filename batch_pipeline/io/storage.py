"""One storage layer for local folders and S3, so the pipeline never branches on where a file lives.

A location is a plain local path (``/data/in.jsonl``, ``runs/x``), a ``file://`` URI
(``file:///data/in.jsonl``; ``file://localhost/...`` is accepted too) or ``s3://bucket/key``.
``file://`` URIs and S3 keys are taken literally: nothing is percent-decoded, so whatever
:func:`join` builds can be passed straight back in.

Guarantees:

* Reads stream. :func:`open_read` returns a buffered binary reader that can be iterated by lines
  (line endings, CRLF and a missing final newline are preserved byte for byte) and whose memory use
  does not depend on the size of the object. An S3 read whose connection drops part way is resumed
  with a ranged GET pinned to the original ETag (``If-Match``), so a changed object fails loudly
  instead of splicing two versions together.
* Writes publish atomically. Local files are written to a hidden temp file in the target directory
  and moved into place with ``os.replace``; S3 objects are a single PUT (or one managed upload for
  :func:`open_write`, which only becomes visible once complete). A failed
  :func:`open_write` publishes nothing.
* Errors are uniform. A missing object (or bucket) raises ``FileNotFoundError`` whose ``filename`` is
  the URI; any other S3 failure raises :class:`StorageError` naming the URI and the S3 error code.
* Transient S3 failures are retried. Every request (PUT, GET, each list page, HEAD, DELETE, each
  part of a managed upload) goes through botocore's retry handler: 500/502/503/504 (``SlowDown``
  included), ``RequestTimeout``, connection resets and connect/read timeouts are retried with
  jittered exponential backoff, up to ``AWS_MAX_ATTEMPTS`` attempts in all. A read that breaks after
  its response started is resumed as described above. Anything else (``AccessDenied``, ...) fails at once.
  Note botocore's own limits: connection errors and 5xx back off from 50 ms (SlowDown from 1 s), so
  8 attempts ride out a few seconds of network trouble, not minutes; and in ``standard``/``adaptive``
  mode each client (one per process here) has a retry quota that a burst of failed retries drains,
  after which failures are not retried until successful calls refill it. ``legacy`` has no quota.

The S3 client is built once per process from the standard AWS environment (``AWS_ENDPOINT_URL``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, credentials) and this package's S3 settings
(``config/settings.py``'s ``S3Settings``: ``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``,
``AWS_CONNECT_TIMEOUT``, ``AWS_READ_TIMEOUT``). If ``S3_SSE`` is set (``AES256``, ``aws:kms``,
``aws:kms:dsse``) every PUT and upload asks for that server-side encryption, with
``S3_SSE_KMS_KEY_ID`` as the KMS key for the ``aws:kms`` modes. Call :func:`reset_clients` after
changing the environment.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import boto3
from boto3.exceptions import Boto3Error, RetriesExceededError, S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from batch_pipeline.config.settings import s3_settings_from_env

__all__ = [
    "ObjectInfo",
    "StorageError",
    "basename",
    "delete",
    "describe",
    "exists",
    "is_hidden",
    "iter_jsonl",
    "is_s3",
    "join",
    "list_objects",
    "local_path",
    "open_read",
    "open_write",
    "read_bytes",
    "read_json",
    "read_text",
    "reset_clients",
    "aws_client",
    "split_s3",
    "s3_client",
    "write_bytes",
    "write_json",
    "json_line",
]

S3_SCHEME = "s3://"
FILE_SCHEME = "file://"

MAX_POOL_CONNECTIONS = 32  # callers upload from thread pools
READ_BUFFER_SIZE = 1 << 20  # bytes held by open_read's buffer
STREAM_RESUMES = 5  # consecutive failed resumes of one S3 read before giving up

# Error codes that mean "there is nothing at this URI".
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchBucket"})


class StorageError(RuntimeError):
    """A storage operation failed for a reason other than the object being missing."""

    def __init__(self, uri: str, code: str, message: str, operation: str = "") -> None:
        self.uri = uri
        self.code = code
        self.operation = operation
        what = f"{operation} {uri}" if operation else uri
        super().__init__(f"{what}: {code}: {message}")


class ObjectInfo(NamedTuple):
    uri: str
    size: int
    etag: str  # S3 ETag without quotes; local files f"{mtime_ns}-{size}"
    modified: float  # seconds since the epoch


# --------------------------------------------------------------------------- locations


def is_s3(uri: str) -> bool:
    return uri[:5].lower() == S3_SCHEME


def _split_scheme(uri: str) -> tuple[str, str]:
    low = uri[:7].lower()
    if low.startswith(S3_SCHEME):
        return S3_SCHEME, uri[5:]
    if low.startswith(FILE_SCHEME):
        return FILE_SCHEME, uri[7:]
    return "", uri


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key) of an s3:// URI."""
    if not is_s3(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"s3 URI without a bucket: {uri!r}")
    return bucket, key


def _s3_uri(bucket: str, key: str) -> str:
    return f"{S3_SCHEME}{bucket}/{key}"


def local_path(uri: str) -> Path | None:
    """The filesystem path of a local location, or None for S3."""
    scheme, rest = _split_scheme(uri)
    if scheme == S3_SCHEME:
        return None
    if scheme == FILE_SCHEME:
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise ValueError(f"file:// URI must be absolute (file:///path): {uri!r}")
    return Path(rest)


def _require_local(uri: str) -> Path:
    path = local_path(uri)
    assert path is not None
    return path


def join(base: str, *parts: str) -> str:
    """Append path segments to a location of either kind, without doubling slashes.

    Leading/trailing slashes of ``parts`` are ignored (a part never restarts from the root), empty
    parts are skipped, and the scheme of ``base`` is kept: ``join("s3://b/", "/x/", "y.jsonl")`` is
    ``"s3://b/x/y.jsonl"`` and ``join("/tmp/", "a")`` is ``"/tmp/a"``.
    """
    segments = [seg for part in parts for seg in part.split("/") if seg]
    if not segments:
        return base
    scheme, rest = _split_scheme(base)
    stripped = rest.rstrip("/")
    if stripped:
        head = stripped + "/"
    elif rest.startswith("/"):
        head = "/"  # the filesystem root, e.g. "/" or "file:///"
    else:
        head = ""  # "" or a bare "s3://"
    return scheme + head + "/".join(segments)


def basename(uri: str) -> str:
    """The last path segment, ignoring a trailing slash; "" for a bucket or filesystem root."""
    if is_s3(uri):
        _, key = split_s3(uri)
        return key.rstrip("/").rsplit("/", 1)[-1]
    return _split_scheme(uri)[1].rstrip("/").rsplit("/", 1)[-1]


# --------------------------------------------------------------------------- S3 client

_client_lock = threading.Lock()
_clients: dict[str, Any] = {}  # AWS service name -> client, for the process _client_pid
_client_pid: int | None = None


def _client_config() -> Config:
    s = s3_settings_from_env()
    # AWS_MAX_ATTEMPTS counts the first try too, which is botocore's "total_max_attempts";
    # retries={"max_attempts": n} would mean n retries (n + 1 attempts).
    return Config(
        retries={"total_max_attempts": s.max_attempts, "mode": s.retry_mode},
        connect_timeout=s.connect_timeout,
        read_timeout=s.read_timeout,
        max_pool_connections=MAX_POOL_CONNECTIONS,
    )


def aws_client(service: str) -> Any:
    """The process-wide client of an AWS service ("s3", "sqs"), created on first use and again in a
    forked child, with this module's retries and timeouts."""
    global _client_pid
    pid = os.getpid()
    client = _clients.get(service) if _client_pid == pid else None
    if client is not None:
        return client
    with _client_lock:
        if _client_pid != pid:
            _clients.clear()
            _client_pid = pid
        if service not in _clients:
            # A private Session: boto3's default session is not safe to create clients from
            # concurrently. Endpoint, region and credentials come from the standard environment.
            _clients[service] = boto3.session.Session().client(service, config=_client_config())
        return _clients[service]


def s3_client() -> Any:
    """The process-wide S3 client (see aws_client)."""
    return aws_client("s3")


def reset_clients() -> None:
    """Forget the cached clients so that the next call picks up the current environment."""
    global _client_pid
    with _client_lock:
        _clients.clear()
        _client_pid = None


def _sse_args() -> dict[str, str]:
    return s3_settings_from_env().sse_args()


def _error_code(exc: ClientError) -> str:
    response = exc.response or {}
    code = response.get("Error", {}).get("Code")
    if code:
        return str(code)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(status) if status else "Unknown"


def _translate(exc: BaseException, uri: str, operation: str) -> Exception:
    if isinstance(exc, S3UploadFailedError):
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ClientError):
            return _translate(cause, uri, operation)
        match = re.search(r"\(([A-Za-z0-9]+)\)", str(exc))
        return StorageError(uri, match.group(1) if match else "UploadFailed", str(exc), operation)
    if isinstance(exc, ClientError):
        code = _error_code(exc)
        if code in _MISSING_CODES:
            what = "bucket does not exist" if code == "NoSuchBucket" else "no such object"
            return FileNotFoundError(errno.ENOENT, f"{what} ({code})", uri)
        message = (exc.response or {}).get("Error", {}).get("Message") or str(exc)
        retries = (exc.response or {}).get("ResponseMetadata", {}).get("RetryAttempts") or 0
        if retries:
            message += f" (gave up after {retries + 1} attempts)"
        return StorageError(uri, code, message, operation)
    if isinstance(exc, RetriesExceededError) and exc.last_exception is not None:
        # s3transfer gave up re-reading a download stream; report the last failure.
        last = exc.last_exception
        return StorageError(uri, type(last).__name__, f"{last} (download retries exhausted)", operation)
    return StorageError(uri, type(exc).__name__, str(exc), operation)


@contextlib.contextmanager
def _s3_errors(uri: str, operation: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError, Boto3Error) as exc:
        raise _translate(exc, uri, operation) from exc


# --------------------------------------------------------------------------- reading


class _S3RawReader(io.RawIOBase):
    """RawIOBase over a GetObject body, resuming with ranged GETs if the stream breaks."""

    def __init__(self, client: Any, uri: str, bucket: str, key: str, response: dict[str, Any]) -> None:
        super().__init__()
        self._client = client
        self._uri = uri
        self._bucket = bucket
        self._key = key
        self._body = response["Body"]
        self._size = int(response["ContentLength"])
        self._etag = response.get("ETag")
        self._pos = 0
        self._failures = 0
        self.resumes = 0  # how often the stream was reopened (observability and tests)

    @property
    def size(self) -> int:
        return self._size

    @property
    def bytes_read(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self._pos >= self._size:
            return 0
        view = memoryview(buffer).cast("B")
        want = min(len(view), self._size - self._pos)
        if want == 0:
            return 0
        while True:
            try:
                data = self._body.read(want)
            except (BotoCoreError, OSError, ValueError) as exc:
                # Broken or closed connection (IncompleteReadError, ResponseStreamingError,
                # ReadTimeoutError, urllib3 ProtocolError, reads on a closed socket ...).
                self._resume(exc)
                continue
            if not data:
                self._resume(None)
                continue
            n = len(data)
            view[:n] = data
            self._pos += n
            self._failures = 0
            return n

    def _resume(self, exc: BaseException | None) -> None:
        self._failures += 1
        if self._failures > STREAM_RESUMES:
            detail = f"{type(exc).__name__}: {exc}" if exc else "stream ended early"
            raise StorageError(
                self._uri, "StreamInterrupted", f"at byte {self._pos} of {self._size}: {detail}", "read"
            ) from exc
        with contextlib.suppress(Exception):
            self._body.close()
        time.sleep(min(0.2 * 2 ** (self._failures - 1), 5.0))
        extra = {"IfMatch": self._etag} if self._etag else {}
        try:
            response = self._client.get_object(
                Bucket=self._bucket, Key=self._key, Range=f"bytes={self._pos}-", **extra
            )
        except ClientError as err:
            if _error_code(err) in ("PreconditionFailed", "412"):
                raise StorageError(self._uri, "PreconditionFailed", "object changed while being read", "read") from err
            raise _translate(err, self._uri, "read") from err
        except BotoCoreError as err:
            raise _translate(err, self._uri, "read") from err
        self._body = response["Body"]
        self.resumes += 1

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._body.close()
        super().close()


def open_read(uri: str) -> BinaryIO:
    """Open a location for streaming binary reads; also usable as a context manager.

    Iterating yields lines with their original endings. Memory use is bounded by the read buffer.
    A missing object raises FileNotFoundError here, not on the first read.
    """
    if not is_s3(uri):
        return open(_require_local(uri), "rb")  # noqa: SIM115 - the caller owns the handle
    bucket, key = split_s3(uri)
    client = s3_client()
    with _s3_errors(uri, "read"):
        response = client.get_object(Bucket=bucket, Key=key)
    raw = _S3RawReader(client, uri, bucket, key, response)
    return io.BufferedReader(raw, buffer_size=READ_BUFFER_SIZE)  # type: ignore[return-value]


def read_bytes(uri: str) -> bytes:
    if not is_s3(uri):
        return _require_local(uri).read_bytes()
    with open_read(uri) as handle:
        return handle.read()


def read_text(uri: str, encoding: str = "utf-8") -> str:
    return read_bytes(uri).decode(encoding)


# --------------------------------------------------------------------------- writing


def _temp_sibling(path: Path) -> Path:
    # Hidden (leading '.') so list_objects never reports a half-written file.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


def _open_new(path: Path) -> BinaryIO:
    # 0o666 & ~umask, like a plain open(); mkstemp would leave 0o600 behind after os.replace.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    return os.fdopen(fd, "wb")


def _publish_local(tmp: Path, target: Path) -> None:
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object atomically (readers see the old content or the new, never a part)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "write"):
            s3_client().put_object(Bucket=bucket, Key=key, Body=bytes(data), **_sse_args())
        return
    with open_write(uri) as handle:
        handle.write(data)


@contextlib.contextmanager
def open_write(uri: str) -> Iterator[BinaryIO]:
    """Write through a local temp file; publish atomically on clean exit, nothing on exception.

    Local targets get a hidden temp file beside them (so the final ``os.replace`` never crosses a
    filesystem); S3 targets spool in ``tempfile.gettempdir()`` and are uploaded as one object.
    """
    if is_s3(uri):
        bucket, key = split_s3(uri)
        fd, name = tempfile.mkstemp(prefix="storage-", suffix=".part")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle  # type: ignore[misc]
            with _s3_errors(uri, "write"):
                s3_client().upload_file(name, bucket, key, ExtraArgs=_sse_args() or None)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return
    target = _require_local(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(target)
    try:
        with _open_new(tmp) as handle:
            yield handle
            if not handle.closed:
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _publish_local(tmp, target)


# --------------------------------------------------------------------------- metadata


def _local_info(uri: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(uri, st.st_size, f"{st.st_mtime_ns}-{st.st_size}", st.st_mtime)


def _etag(value: str | None) -> str:
    return (value or "").strip('"')


def describe(uri: str) -> ObjectInfo:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "describe"):
            head = s3_client().head_object(Bucket=bucket, Key=key)
        return ObjectInfo(uri, int(head["ContentLength"]), _etag(head.get("ETag")), head["LastModified"].timestamp())
    path = _require_local(uri)
    st = path.stat()
    if not os.path.isfile(path):
        raise IsADirectoryError(errno.EISDIR, "not a file", uri)
    return _local_info(uri, st)


def exists(uri: str) -> bool:
    """Whether an object / regular file exists at ``uri`` (a local directory does not count)."""
    if not is_s3(uri):
        return _require_local(uri).is_file()
    try:
        describe(uri)
    except FileNotFoundError:
        return False
    return True


def is_hidden(relative: str) -> bool:
    """Whether a path below a listed folder is hidden (a segment starts with '.'): never listed."""
    return any(segment.startswith(".") for segment in relative.split("/"))


def _prefix_key(prefix_uri: str) -> tuple[str, str]:
    """Bucket and key prefix, treating the prefix as a folder (``runs/a`` never matches ``runs/ab``)."""
    bucket, key = split_s3(prefix_uri)
    if key and not key.endswith("/"):
        key += "/"
    return bucket, key


def list_objects(prefix_uri: str, suffix: str | None = None, recursive: bool = True) -> list[ObjectInfo]:
    """Objects under a folder-like prefix, sorted by URI.

    Hidden entries (any path segment below the prefix starting with '.') are skipped, as are S3
    folder markers (keys ending in '/'). A missing local folder or empty prefix gives [].
    """
    found: list[ObjectInfo] = []
    if is_s3(prefix_uri):
        bucket, key_prefix = _prefix_key(prefix_uri)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": key_prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        with _s3_errors(prefix_uri, "list"):
            for page in s3_client().get_paginator("list_objects_v2").paginate(**kwargs):
                for obj in page.get("Contents", ()):
                    key = obj["Key"]
                    relative = key[len(key_prefix) :]
                    if not relative or key.endswith("/") or is_hidden(relative):
                        continue
                    if suffix and not key.endswith(suffix):
                        continue
                    found.append(
                        ObjectInfo(
                            _s3_uri(bucket, key),
                            int(obj["Size"]),
                            _etag(obj.get("ETag")),
                            obj["LastModified"].timestamp(),
                        )
                    )
    else:
        root = _require_local(prefix_uri)
        if not root.is_dir():
            return []
        if recursive:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel_dir = os.path.relpath(dirpath, root)
                for name in filenames:
                    if name.startswith(".") or (suffix and not name.endswith(suffix)):
                        continue
                    relative = name if rel_dir == "." else f"{rel_dir}/{name}"
                    with contextlib.suppress(FileNotFoundError):  # deleted while walking
                        found.append(_local_info(join(prefix_uri, relative), os.stat(os.path.join(dirpath, name))))
        else:
            with os.scandir(root) as entries:
                for entry in entries:
                    if entry.name.startswith(".") or (suffix and not entry.name.endswith(suffix)):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if entry.is_file():
                            found.append(_local_info(join(prefix_uri, entry.name), entry.stat()))
    found.sort(key=lambda info: info.uri)
    return found


# --------------------------------------------------------------------------- deleting


def delete(uri: str) -> None:
    """Delete one object / file; a missing one is fine."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "delete"):
            s3_client().delete_object(Bucket=bucket, Key=key)
        return
    _require_local(uri).unlink(missing_ok=True)


# --------------------------------------------------------------------------- JSON files


def json_line(obj: Any) -> bytes:
    """One compact JSON Lines record (UTF-8, newline-terminated)."""
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def write_json(uri: str, obj: Any) -> None:
    """An indented JSON document, written atomically."""
    write_bytes(uri, (json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))


def read_json(uri: str) -> Any:
    return json.loads(read_text(uri))


def iter_jsonl(uri: str) -> Iterator[dict[str, Any]]:
    """The records of a JSON Lines object, streamed; blank lines are skipped."""
    with open_read(uri) as f:
        for raw in f:
            if raw.strip():
                yield json.loads(raw)

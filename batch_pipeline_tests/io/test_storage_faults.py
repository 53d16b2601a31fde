"""Storage under S3 faults: transient errors are retried without losing or duplicating a line,
permanent ones fail fast with the URI and the S3 code.

Faults are injected over real HTTP by a proxy (fault_proxy.py) between boto3 and moto's S3 server
(s3_server.py, its own process): 503 SlowDown / ServiceUnavailable, 500 InternalError, 403
AccessDenied, TCP resets (before the answer, partway through an upload, after the write was
committed, in the middle of a multi-MB GET body) and silent connections that outlast the client's
read timeout. Covers write_bytes, open_write (single PUT with ``Expect: 100-continue`` and a multipart upload),
open_read streaming (botocore retries before the body, storage's ranged If-Match resume inside it),
list_objects across pages, describe/exists, delete, retries running out (AWS_MAX_ATTEMPTS=3), and the batch validation
step (validate_batch) reading and writing S3 through the faults, checked byte for byte against the
same step on local files.

Does not patch boto3/botocore, does not touch real AWS, ~/.aws, Dagster or vLLM, and does not test
connect timeouts (the proxy always accepts) or TLS.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.io import storage
from batch_pipeline.steps.ingest import validate_batch
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.steps.validation import ValidationSettings
from batch_pipeline_tests.support.fault_proxy import FaultProxy, fault_proxy  # noqa: F401 - fixture
from batch_pipeline_tests.support.s3_server import MotoS3, apply_env

READ_TIMEOUT = 10.0  # seconds: generous, so a slow moment of moto is never taken for a fault
SHORT_READ_TIMEOUT = 1.0  # seconds: only where a "timeout" fault must be noticed quickly
MB = 1_000_000


@dataclass
class S3:
    bucket: str
    proxy: FaultProxy
    direct: Any  # boto3 client straight to moto, bypassing the proxy (setup and checks)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.direct.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        return self.direct.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.direct.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", ())]


def short_read_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client gives up on a silent connection after SHORT_READ_TIMEOUT (a spurious timeout on a
    busy machine is one more retry, so tests using this assert retry counts as lower bounds)."""
    monkeypatch.setenv("AWS_READ_TIMEOUT", str(SHORT_READ_TIMEOUT))
    storage.reset_clients()


def point_storage_at(proxy: FaultProxy, moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    apply_env(monkeypatch, moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
    monkeypatch.setenv("AWS_READ_TIMEOUT", str(READ_TIMEOUT))
    monkeypatch.setenv("AWS_CONNECT_TIMEOUT", "2")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)  # storage's default: 8 attempts
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)  # standard
    storage.reset_clients()


@pytest.fixture(scope="module")
def direct(moto_server: MotoS3) -> Any:
    """One boto3 client straight to moto for the whole module (setup and independent checks)."""
    return moto_server.client()


@pytest.fixture
def s3(
    fault_proxy: FaultProxy, moto_server: MotoS3, direct: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> Iterator[S3]:
    """A fresh bucket; storage talks to it through the fault proxy, `direct` does not."""
    bucket = f"faults-{uuid.uuid4().hex[:16]}"
    direct.create_bucket(Bucket=bucket)
    point_storage_at(fault_proxy, moto_server, monkeypatch)
    yield S3(bucket, fault_proxy, direct)
    storage.reset_clients()


LISTED = 1105  # > 1000: list_objects_v2 needs a second page


@pytest.fixture(scope="module")
def listed_bucket(direct: Any) -> str:
    """A bucket with LISTED small objects under "many/", created once for the listing tests."""
    bucket = f"faults-list-{uuid.uuid4().hex[:12]}"
    direct.create_bucket(Bucket=bucket)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: direct.put_object(Bucket=bucket, Key=f"many/{i:05d}.jsonl", Body=b"{}\n"), range(LISTED)))
    return bucket


def jsonl(count: int, width: int = 100) -> bytes:
    """Numbered JSONL lines, some CRLF-terminated, the last one without a newline."""
    rows = [
        b'{"custom_id":"r%07d","pad":"%s"}%s' % (i, b"x" * (width + i % 7), b"\r\n" if i % 5 == 0 else b"\n")
        for i in range(count)
    ]
    rows[-1] = rows[-1].rstrip(b"\r\n")
    return b"".join(rows)


PAYLOAD = jsonl(16_000)  # ~2 MB
BIG = jsonl(26_000)  # ~3.4 MB: several 1 MiB buffers of open_read


def lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


# --------------------------------------------------------------------------- the proxy itself


def test_proxy_forwards_and_keeps_connections_alive(s3: S3) -> None:
    storage.write_bytes(s3.uri("a.jsonl"), PAYLOAD)
    assert storage.read_bytes(s3.uri("a.jsonl")) == PAYLOAD
    assert storage.exists(s3.uri("a.jsonl"))
    assert [o.uri for o in storage.list_objects(s3.uri(""))] == [s3.uri("a.jsonl")]
    assert s3.proxy.injected() == 0
    assert s3.proxy.count() == 4
    assert s3.proxy.connections == 1  # boto3 reused one connection for all four requests


def test_proxy_relays_chunked_request_bodies(s3: S3) -> None:
    # botocore sends Content-Length over plain HTTP, but the proxy must not choke on chunked bodies.
    conn = http.client.HTTPConnection("127.0.0.1", s3.proxy.port, timeout=10)
    conn.request("PUT", f"/{s3.bucket}/chunked.jsonl", body=iter([b"a\n", b"bb\n", b"ccc\n"]), encode_chunked=True)
    assert conn.getresponse().read() is not None
    conn.close()
    assert s3.get("chunked.jsonl") == b"a\nbb\nccc\n"


# --------------------------------------------------------------------------- writes

WRITE_FAULTS = [
    pytest.param("slowdown", {}, id="slowdown"),
    pytest.param("500", {}, id="500"),
    pytest.param("reset", {"after_request_bytes": MB}, id="reset-mid-upload"),
    pytest.param("reset", {}, id="reset"),
    pytest.param("reset", {"forward": True}, id="reset-after-commit"),  # the PUT landed, its answer was lost
    pytest.param("timeout", {}, id="timeout"),
]


def _write_bytes(uri: str, data: bytes) -> None:
    storage.write_bytes(uri, data)


def _open_write(uri: str, data: bytes) -> None:
    with storage.open_write(uri) as handle:
        for start in range(0, len(data), 64 * 1024):
            handle.write(data[start : start + 64 * 1024])


@pytest.mark.parametrize("write", [_write_bytes, _open_write], ids=["write_bytes", "open_write"])
@pytest.mark.parametrize(("kind", "options"), WRITE_FAULTS)
def test_write_survives_transient_fault(
    s3: S3, monkeypatch: pytest.MonkeyPatch, write: Any, kind: str, options: dict[str, Any]
) -> None:
    if kind == "timeout":
        short_read_timeout(monkeypatch)
    s3.put("out.jsonl", b"old content\n")
    s3.proxy.fail_next(1, kind, method="PUT", **options)
    write(s3.uri("out.jsonl"), PAYLOAD)
    assert s3.proxy.injected(kind, method="PUT") == 1
    puts = [s for s in s3.proxy.seen if s.method == "PUT"]
    assert len(puts) == 2 or (kind == "timeout" and len(puts) > 2)  # the faulted attempt, one retry
    if options.get("forward"):
        assert puts[0].upstream == 200 and puts[0].status is None  # S3 stored it; the client never knew
    assert all(p.expect_continue for p in puts)  # botocore sends Expect: 100-continue with PUT bodies
    assert lines(s3.get("out.jsonl")) == lines(PAYLOAD)
    assert s3.get("out.jsonl") == PAYLOAD


def test_multipart_upload_survives_faults_on_every_step(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    short_read_timeout(monkeypatch)
    data = jsonl(80_000)  # ~9 MB > boto3's 8 MiB multipart threshold: create, 2 parts, complete
    assert len(data) > 8 * 2**20
    s3.proxy.fail_next(1, "503", method="POST", match="?uploads")
    s3.proxy.fail_next(1, "reset", method="PUT", match="partNumber=2")
    s3.proxy.fail_next(1, "timeout", method="PUT", match="partNumber=1")
    s3.proxy.fail_next(1, "500", method="POST", match="uploadId=")
    _open_write(s3.uri("big.jsonl"), data)
    assert s3.proxy.injected() == 4 and s3.proxy.pending == 0
    assert s3.get("big.jsonl") == data
    assert s3.direct.list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


# --------------------------------------------------------------------------- streaming reads

READ_FAULTS = [
    # (plan, resumes expected)
    pytest.param([("slowdown", None)], 0, id="slowdown-before-body"),
    pytest.param([("500", None)], 0, id="500-before-body"),
    pytest.param([("reset", None)], 0, id="reset-before-answer"),
    pytest.param([("timeout", None)], 0, id="timeout-before-answer"),
    pytest.param([("reset", int(1.5 * MB))], 1, id="reset-mid-body"),
    pytest.param([("timeout", int(1.5 * MB))], 1, id="stall-mid-body"),
    pytest.param([("reset", int(1.5 * MB)), ("slowdown", None), ("reset", MB)], 2, id="reset-slowdown-reset"),
]


@pytest.mark.parametrize(("plan", "resumes"), READ_FAULTS)
def test_streaming_read_survives_fault(
    s3: S3, monkeypatch: pytest.MonkeyPatch, plan: list[tuple[str, int | None]], resumes: int
) -> None:
    timeouts = any(kind == "timeout" for kind, _ in plan)
    if timeouts:
        short_read_timeout(monkeypatch)
    s3.put("in.jsonl", BIG)
    for kind, after_bytes in plan:
        s3.proxy.fail_next(1, kind, method="GET", after_bytes=after_bytes)
    with storage.open_read(s3.uri("in.jsonl")) as handle:
        got = list(handle)
        reopened = handle.raw.resumes  # type: ignore[attr-defined]
    assert reopened == resumes or (timeouts and reopened > resumes)
    assert got == lines(BIG)  # nothing lost, nothing twice, line ends as they were
    assert s3.proxy.injected() == len(plan) and s3.proxy.pending == 0
    answered = [s.upstream for s in s3.proxy.seen if s.upstream is not None]
    assert answered[0] == 200 and set(answered[1:]) <= {206}  # every resume is a ranged GET
    assert answered.count(206) >= resumes


def test_read_resume_fails_fast_on_a_permanent_error(s3: S3) -> None:
    s3.put("in.jsonl", BIG)
    s3.proxy.fail_next(1, "reset", method="GET", after_bytes=MB)
    s3.proxy.fail_next(1, "403", method="GET")
    with storage.open_read(s3.uri("in.jsonl")) as handle:
        with pytest.raises(storage.StorageError) as err:
            handle.read()
    assert err.value.code == "AccessDenied" and err.value.uri == s3.uri("in.jsonl")
    assert s3.uri("in.jsonl") in str(err.value)


# --------------------------------------------------------------------------- listing and metadata


@pytest.fixture
def listing(
    listed_bucket: str, fault_proxy: FaultProxy, moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> Iterator[str]:
    """The shared listing bucket, with storage pointed at it through the fault proxy."""
    point_storage_at(fault_proxy, moto_server, monkeypatch)
    yield listed_bucket
    storage.reset_clients()


@pytest.mark.parametrize("kind", ["slowdown", "reset", "timeout"])
def test_list_objects_survives_fault_on_second_page(
    listing: str, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, kind: str  # noqa: F811
) -> None:
    if kind == "timeout":
        short_read_timeout(monkeypatch)
    fault_proxy.fail_next(1, kind, method="GET", match="continuation-token")
    found = storage.list_objects(f"s3://{listing}/many")
    assert [o.uri for o in found] == [f"s3://{listing}/many/{i:05d}.jsonl" for i in range(LISTED)]
    assert fault_proxy.injected(kind, match="continuation-token") == 1
    page2 = fault_proxy.count(match="continuation-token")  # asked for twice, kept once
    assert page2 == 2 or (kind == "timeout" and page2 > 2)


@pytest.mark.parametrize("kind", ["slowdown", "500", "reset", "timeout"])
def test_describe_and_exists_survive_fault(s3: S3, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "timeout":
        short_read_timeout(monkeypatch)
    s3.put("a.jsonl", PAYLOAD)
    head = s3.direct.head_object(Bucket=s3.bucket, Key="a.jsonl")
    s3.proxy.fail_next(1, kind, method="HEAD")
    info = storage.describe(s3.uri("a.jsonl"))
    assert (info.size, info.etag) == (len(PAYLOAD), head["ETag"].strip('"'))
    assert storage.exists(s3.uri("a.jsonl"))
    s3.proxy.fail_next(1, kind, method="HEAD")
    assert not storage.exists(s3.uri("missing.jsonl"))  # a retried 404 is still "missing"
    assert s3.proxy.injected(kind, method="HEAD") == 2


def test_delete_survives_faults(s3: S3) -> None:
    s3.put("runs/x/0.jsonl", b"x\n")
    s3.put("keep.jsonl", b"k\n")
    s3.proxy.fail_next(1, "500", method="DELETE")
    storage.delete(s3.uri("runs/x/0.jsonl"))
    assert s3.keys() == ["keep.jsonl"]
    assert s3.proxy.injected() == 1


# --------------------------------------------------------------------------- permanent errors and exhausted retries


PERMANENT = [
    pytest.param("PUT", _write_bytes, id="write_bytes"),
    pytest.param("PUT", _open_write, id="open_write"),
    pytest.param("GET", lambda uri, _data: storage.open_read(uri), id="open_read"),
    pytest.param("HEAD", lambda uri, _data: storage.describe(uri), id="describe"),
    pytest.param("GET", lambda uri, _data: storage.list_objects(uri.rsplit("/", 1)[0]), id="list_objects"),
    pytest.param("DELETE", lambda uri, _data: storage.delete(uri), id="delete"),
]


@pytest.mark.parametrize(("method", "operation"), PERMANENT)
def test_permanent_403_fails_fast_naming_uri_and_code(s3: S3, method: str, operation: Any) -> None:
    s3.put("dir/a.jsonl", PAYLOAD)
    uri = s3.uri("dir/a.jsonl")
    assert not storage.exists(s3.uri("warm-up"))  # the client's first call pays for its setup
    s3.proxy.fail_next(5, "403", method=method)
    started = time.monotonic()
    with pytest.raises(storage.StorageError) as err:
        operation(uri, PAYLOAD)
    assert time.monotonic() - started < 2.0
    assert err.value.code in ("AccessDenied", "403")  # a HEAD answer has no body, only the status
    assert err.value.uri in (uri, s3.uri("dir")) and err.value.uri in str(err.value)
    assert err.value.code in str(err.value)
    assert s3.proxy.injected("403") == 1  # not retried
    assert s3.get("dir/a.jsonl") == PAYLOAD


EXHAUSTED = [
    pytest.param("slowdown", "PUT", _write_bytes, "SlowDown", id="slowdown-put"),
    pytest.param("500", "PUT", _open_write, "InternalError", id="500-open_write"),
    pytest.param("reset", "GET", lambda uri, _data: storage.read_bytes(uri), "ConnectionClosedError", id="reset-get"),
    pytest.param("503", "HEAD", lambda uri, _data: storage.exists(uri), "503", id="503-head"),
]


@pytest.mark.parametrize(("kind", "method", "operation", "code"), EXHAUSTED)
def test_exhausted_retries_fail_with_a_clear_error(
    s3: S3, monkeypatch: pytest.MonkeyPatch, kind: str, method: str, operation: Any, code: str
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    storage.reset_clients()
    s3.put("a.jsonl", b"old\n")
    s3.proxy.fail_next(10, kind, method=method)
    with pytest.raises(storage.StorageError) as err:
        operation(s3.uri("a.jsonl"), PAYLOAD)
    assert err.value.code == code and err.value.uri == s3.uri("a.jsonl")
    assert s3.uri("a.jsonl") in str(err.value) and code in str(err.value)
    if kind != "reset":  # an HTTP answer carries botocore's attempt count; a dropped connection does not
        assert "gave up after 3 attempts" in str(err.value)
    assert s3.proxy.injected(kind) == 3  # AWS_MAX_ATTEMPTS counts every attempt, the first included
    assert s3.get("a.jsonl") == b"old\n"


# --------------------------------------------------------------------------- the validation step


def batch_input() -> tuple[bytes, list[str], int]:
    """~2.5 MB of requests: valid chat lines, some for another model, some broken JSON."""
    out, valid, invalid = [], [], 0
    for i in range(10_000):
        cid = f"req-{i:05d}"
        if i % 97 == 3:
            out.append(b'{"custom_id": "%s", "method": "POST", "url": "/v1/chat/co' % cid.encode())  # cut short
            invalid += 1
            continue
        model = "other" if i % 89 == 5 else "m"
        body = {"model": model, "messages": [{"role": "user", "content": f"question {i} " + "pad " * 40}], "max_tokens": 8}
        out.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}).encode())
        if model == "m":
            valid.append(cid)
        else:
            invalid += 1
    return b"\n".join(out) + b"\n", valid, invalid


def _custom_id(record: dict[str, Any]) -> str:
    return record["custom_id"] if "custom_id" in record else record["request"]["custom_id"]


def test_validate_batch_on_s3_survives_storage_faults(s3: S3, tmp_path: Path) -> None:
    data, valid_ids, invalid_count = batch_input()
    settings = ValidationSettings(served_model_name="m")

    # The same step on local files is the reference output.
    (tmp_path / "in.jsonl").write_bytes(data)
    local = BatchLocation("in", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "2024-01-01")
    local_info = validate_batch(local, settings)

    s3.put("inputs/in.jsonl", data)
    loc = BatchLocation("in", s3.uri("inputs/in.jsonl"), s3.uri("out/in"), "2024-01-01")
    s3.proxy.fail_next(1, "reset", method="GET", match="inputs/in.jsonl", after_bytes=MB)  # mid-body
    s3.proxy.fail_next(1, "slowdown", method="GET", match="inputs/in.jsonl")  # on the resume
    s3.proxy.fail_next(1, "slowdown", method="PUT", match="requests.jsonl")
    s3.proxy.fail_next(1, "reset", method="PUT", match="invalid.jsonl")
    s3.proxy.fail_next(1, "reset", method="PUT", match="validation.json", forward=True)
    info = validate_batch(loc, settings)
    assert s3.proxy.injected() == 5 and s3.proxy.pending == 0

    requests = s3.get("out/in/_work/requests.jsonl")
    invalid = s3.get("out/in/_work/invalid.jsonl")
    assert requests == (tmp_path / "out/_work/requests.jsonl").read_bytes()
    assert invalid == (tmp_path / "out/_work/invalid.jsonl").read_bytes()
    assert [_custom_id(json.loads(x)) for x in requests.splitlines()] == valid_ids
    assert len(invalid.splitlines()) == invalid_count
    stored = json.loads(s3.get("out/in/_work/validation.json"))
    for key in ("sha256", "bytes", "lines", "valid", "invalid", "errors_by_code"):
        assert info[key] == stored[key] == local_info[key], key
    assert (info["valid"], info["invalid"]) == (len(valid_ids), invalid_count)

"""Tests for batch_pipeline.io.storage: one API over local folders, file:// URIs and s3:// URIs.

Covers: join/basename/local_path, write/read/exists/describe/delete round trips, byte-exact streaming
of lines (CRLF, no final newline) and bounded read-ahead, resuming a broken S3 read (and refusing
when the object changed meanwhile), atomic open_write (nothing published on exception),
list_objects (hidden files, suffix, non-recursive, sibling prefixes, >1000 keys via pagination), the
JSON helpers, ETag changes, error mapping (FileNotFoundError naming the URI, StorageError with the S3
code) and S3_SSE on PUT and streamed writes.

S3 is moto's standalone server on 127.0.0.1 spoken to over real HTTP (see s3_server.py); boto3 is
not mocked. Does not touch real AWS, ~/.aws, Dagster or vLLM; local files live in pytest's tmp_path.
"""

from __future__ import annotations

import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batch_pipeline.config.settings import S3Settings
from batch_pipeline.io import storage
from batch_pipeline_tests.support.s3_server import MotoS3

KINDS = ["local", "file", "s3"]


@pytest.fixture(params=KINDS)
def base(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty folder-like location of each kind."""
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "file":
        return "file://" + str(tmp_path / "root")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/root"


# --------------------------------------------------------------------------- locations


@pytest.mark.parametrize(
    ("base_uri", "parts", "expected"),
    [
        ("s3://bucket", ("a", "b.jsonl"), "s3://bucket/a/b.jsonl"),
        ("s3://bucket/", ("/a/", "/b.jsonl"), "s3://bucket/a/b.jsonl"),
        ("s3://bucket/pre//", ("a//b",), "s3://bucket/pre/a/b"),
        ("s3://", ("bucket", "k"), "s3://bucket/k"),
        ("s3://bucket/pre", (), "s3://bucket/pre"),
        ("s3://bucket/pre", ("", "/", "x"), "s3://bucket/pre/x"),
        ("/tmp/x", ("y", "z.txt"), "/tmp/x/y/z.txt"),
        ("/tmp/x/", ("/y",), "/tmp/x/y"),
        ("/", ("etc",), "/etc"),
        ("relative/dir", ("f",), "relative/dir/f"),
        ("", ("a", "b"), "a/b"),
        ("file:///data/", ("in.jsonl",), "file:///data/in.jsonl"),
        ("file:///", ("data",), "file:///data"),
    ],
)
def test_join(base_uri: str, parts: tuple[str, ...], expected: str) -> None:
    assert storage.join(base_uri, *parts) == expected


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket/a/b.jsonl", "b.jsonl"),
        ("s3://bucket/a/dir/", "dir"),
        ("s3://bucket/top", "top"),
        ("s3://bucket", ""),
        ("s3://bucket/", ""),
        ("/tmp/x/y.txt", "y.txt"),
        ("/tmp/x/", "x"),
        ("y.txt", "y.txt"),
        ("file:///data/in.jsonl", "in.jsonl"),
        ("/", ""),
    ],
)
def test_basename(uri: str, expected: str) -> None:
    assert storage.basename(uri) == expected


@pytest.mark.parametrize(
    ("uri", "s3", "path"),
    [
        ("s3://b/k", True, None),
        ("S3://b/k", True, None),
        ("/tmp/a", False, Path("/tmp/a")),
        ("rel/a", False, Path("rel/a")),
        ("file:///tmp/a", False, Path("/tmp/a")),
        ("file://localhost/tmp/a", False, Path("/tmp/a")),
        ("file:///tmp/a%20b", False, Path("/tmp/a%20b")),  # taken literally, never percent-decoded
    ],
)
def test_is_s3_and_local_path(uri: str, s3: bool, path: Path | None) -> None:
    assert storage.is_s3(uri) is s3
    assert storage.local_path(uri) == path


def test_relative_file_uri_is_rejected() -> None:
    with pytest.raises(ValueError, match="absolute"):
        storage.local_path("file://relative/path")


# --------------------------------------------------------------------------- round trips


def test_round_trip(base: str) -> None:
    uri = storage.join(base, "deep", "er", "obj.jsonl")
    assert not storage.exists(uri)
    storage.write_bytes(uri, b'{"a": 1}\n')  # creates parent folders locally
    assert storage.exists(uri)
    assert storage.read_bytes(uri) == b'{"a": 1}\n'
    assert storage.read_text(uri) == '{"a": 1}\n'
    info = storage.describe(uri)
    assert (info.uri, info.size) == (uri, 9)
    assert info.etag and info.modified > 0
    storage.write_bytes(uri, "ünïcode\n".encode())
    assert storage.read_text(uri) == "ünïcode\n"
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # deleting a missing object is fine


def test_local_write_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "out" / "x.bin"
    storage.write_bytes(str(target), b"1")
    storage.write_bytes(str(target), b"22")
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.bin"]
    assert target.read_bytes() == b"22"


def test_open_read_preserves_bytes_and_line_ends(base: str) -> None:
    payload = b'{"x": 1}\r\n{"y": "\xc3\xa9"}\n\n{"z": 3}\r\nlast line without newline'
    uri = storage.join(base, "lines.jsonl")
    storage.write_bytes(uri, payload)
    with storage.open_read(uri) as handle:
        lines = [raw for raw in handle]
    assert lines == [b'{"x": 1}\r\n', b'{"y": "\xc3\xa9"}\n', b"\n", b'{"z": 3}\r\n', b"last line without newline"]
    assert b"".join(lines) == payload


def test_open_read_empty_object(base: str) -> None:
    uri = storage.join(base, "empty")
    storage.write_bytes(uri, b"")
    with storage.open_read(uri) as handle:
        assert list(handle) == []
    assert storage.describe(uri).size == 0


def test_s3_open_read_streams_with_bounded_read_ahead(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/big.jsonl"
    line = b'{"custom_id": "r", "body": "' + b"x" * 100 + b'"}\n'
    payload = line * (4 * storage.READ_BUFFER_SIZE // len(line) + 1)  # > 4 MiB
    storage.write_bytes(uri, payload)
    with storage.open_read(uri) as handle:
        assert handle.readline() == line
        raw = handle.raw  # type: ignore[attr-defined]
        assert raw.size == len(payload)
        assert raw.bytes_read <= storage.READ_BUFFER_SIZE  # only one buffer fetched so far
        count = 1 + sum(1 for _ in handle)
    assert count * len(line) == len(payload)


def test_s3_open_read_resumes_after_broken_connection(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/resume.jsonl"
    payload = b"".join(b"line %07d\r\n" % i for i in range(300_000))  # ~3.9 MB
    storage.write_bytes(uri, payload)
    with storage.open_read(uri) as handle:
        first = handle.readline()
        handle.raw._body.close()  # type: ignore[attr-defined]  # drop the HTTP connection mid-object
        rest = handle.read()
        assert handle.raw.resumes == 1  # type: ignore[attr-defined]
    assert first + rest == payload


def test_s3_open_read_refuses_to_splice_a_changed_object(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/changing.jsonl"
    storage.write_bytes(uri, b"old\n" * 1_000_000)
    with storage.open_read(uri) as handle:
        handle.readline()
        handle.raw._body.close()  # type: ignore[attr-defined]
        storage.write_bytes(uri, b"new\n" * 1_000_000)
        with pytest.raises(storage.StorageError) as err:
            handle.read()
    assert err.value.code == "PreconditionFailed"
    assert uri in str(err.value)


# --------------------------------------------------------------------------- open_write


def test_open_write_publishes_on_clean_exit(base: str) -> None:
    uri = storage.join(base, "sub", "out.jsonl")
    with storage.open_write(uri) as handle:
        handle.write(b"a\n")
        handle.write(b"b\r\n")
        assert not storage.exists(uri)  # nothing visible until the block ends
    assert storage.read_bytes(uri) == b"a\nb\r\n"
    assert [info.uri for info in storage.list_objects(base)] == [uri]


def test_open_write_publishes_nothing_on_exception(
    base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"  # where S3 writes are staged
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    fresh = storage.join(base, "fresh.jsonl")
    kept = storage.join(base, "kept.jsonl")
    storage.write_bytes(kept, b"previous\n")

    for uri in (fresh, kept):
        with pytest.raises(RuntimeError, match="boom"):
            with storage.open_write(uri) as handle:
                handle.write(b"partial\n" * 1000)
                raise RuntimeError("boom")

    assert not storage.exists(fresh)
    assert storage.read_bytes(kept) == b"previous\n"
    assert [info.uri for info in storage.list_objects(base)] == [kept]
    assert list(spool.iterdir()) == []  # S3 staging file removed
    local = storage.local_path(base)
    if local is not None:  # no hidden temp files left beside the target
        assert sorted(p.name for p in local.iterdir()) == ["kept.jsonl"]


# --------------------------------------------------------------------------- transfer


def test_list_objects_filters_and_sorts(base: str) -> None:
    for rel in ["b.jsonl", "a.jsonl", "_meta.jsonl", "notes.txt", "sub/c.jsonl", "sub/deeper/d.jsonl",
                ".hidden.jsonl", "sub/.part.jsonl", ".cache/e.jsonl"]:
        storage.write_bytes(storage.join(base, rel), rel.encode())
    storage.write_bytes(base + "x/sibling.jsonl", b"not under base")  # "root" must not match "rootx"

    def rels(infos: list[storage.ObjectInfo]) -> list[str]:
        return [info.uri[len(base) + 1 :] for info in infos]

    everything = storage.list_objects(base)
    assert rels(everything) == ["_meta.jsonl", "a.jsonl", "b.jsonl", "notes.txt", "sub/c.jsonl", "sub/deeper/d.jsonl"]
    assert all(info.size == len(rel) for info, rel in zip(everything, rels(everything)))
    assert rels(storage.list_objects(base + "/", suffix=".jsonl")) == [
        "_meta.jsonl", "a.jsonl", "b.jsonl", "sub/c.jsonl", "sub/deeper/d.jsonl"]
    assert rels(storage.list_objects(base, recursive=False)) == ["_meta.jsonl", "a.jsonl", "b.jsonl", "notes.txt"]
    assert storage.list_objects(storage.join(base, "missing")) == []


def test_etag_changes_with_content(base: str) -> None:
    uri = storage.join(base, "e.jsonl")
    storage.write_bytes(uri, b"one\n")
    first = storage.describe(uri).etag
    assert storage.describe(uri).etag == first  # stable while unchanged
    storage.write_bytes(uri, b"two\n")  # same size, different content
    second = storage.describe(uri).etag
    assert second != first
    listed = storage.list_objects(base)
    assert [(info.uri, info.etag) for info in listed] == [(uri, second)]


def test_local_etag_format(tmp_path: Path) -> None:
    path = tmp_path / "f"
    storage.write_bytes(str(path), b"abc")
    st = path.stat()
    assert storage.describe(str(path)).etag == f"{st.st_mtime_ns}-3"


def test_s3_missing_error_details(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/nope.jsonl"
    with pytest.raises(FileNotFoundError) as err:
        storage.read_bytes(uri)
    assert err.value.filename == uri
    assert "NoSuchKey" in str(err.value)
    with pytest.raises(FileNotFoundError, match="NoSuchBucket"):
        storage.read_bytes("s3://bucket-that-does-not-exist-4242/k")


def test_other_s3_errors_raise_storage_error_with_code(s3_bucket: str, moto_server: MotoS3) -> None:
    moto_server.client().put_object(Bucket=s3_bucket, Key="cold", Body=b"x", StorageClass="GLACIER")
    uri = f"s3://{s3_bucket}/cold"
    with pytest.raises(storage.StorageError) as err:
        storage.read_bytes(uri)
    assert err.value.code == "InvalidObjectState"
    assert err.value.uri == uri and uri in str(err.value) and "InvalidObjectState" in str(err.value)
    assert isinstance(err.value, RuntimeError)
    with pytest.raises(storage.StorageError, match="ParamValidationError"):  # client-side botocore error
        storage.write_bytes("s3://Not_A_Valid_Bucket!/k", b"x")


# --------------------------------------------------------------------------- client & SSE


def test_sse_kms_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("S3_SSE", raising=False)
    assert storage._sse_args() == {}
    monkeypatch.setenv("S3_SSE", "aws:kms")
    monkeypatch.setenv("S3_SSE_KMS_KEY_ID", "alias/batch")
    assert storage._sse_args() == {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/batch"}
    monkeypatch.setenv("S3_SSE", "AES256")  # a KMS key id is meaningless for SSE-S3
    assert storage._sse_args() == {"ServerSideEncryption": "AES256"}


def test_client_is_shared_and_reset_follows_env(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    barrier = threading.Barrier(8)

    def grab() -> None:
        barrier.wait()
        seen.append(storage.s3_client())

    storage.reset_clients()
    threads = [threading.Thread(target=grab) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(client) for client in seen}) == 1
    client = seen[0]
    assert client.meta.endpoint_url == s3_env["AWS_ENDPOINT_URL"]  # type: ignore[attr-defined]
    assert client.meta.config.retries["total_max_attempts"] == S3Settings().max_attempts  # type: ignore[attr-defined]

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    assert storage.s3_client() is client  # cached until reset
    storage.reset_clients()
    assert storage.s3_client().meta.config.retries["total_max_attempts"] == 3  # type: ignore[attr-defined]


def test_list_objects_paginates_past_1000_keys(s3_bucket: str) -> None:
    prefix = f"s3://{s3_bucket}/many"
    uris = [f"{prefix}/part-{i:05d}.jsonl" for i in range(1050)]
    with ThreadPoolExecutor(max_workers=16) as pool:  # also exercises the shared client from threads
        list(pool.map(lambda uri: storage.write_bytes(uri, b"{}\n"), uris))
    infos = storage.list_objects(prefix)
    assert [info.uri for info in infos] == uris
    assert {info.size for info in infos} == {3}


def test_missing_object_raises_file_not_found_naming_uri(base: str) -> None:
    uri = storage.join(base, "no", "such.jsonl")
    for call in (storage.read_bytes, storage.open_read, storage.describe, storage.read_text, storage.read_json):
        with pytest.raises(FileNotFoundError) as err:
            call(uri)
        assert uri in str(err.value) or str(storage.local_path(uri)) in str(err.value)
    assert not storage.exists(uri)


def test_json_helpers_round_trip(base: str) -> None:
    storage.write_json(storage.join(base, "doc.json"), {"name": "café", "n": [1, 2]})
    assert storage.read_json(storage.join(base, "doc.json")) == {"name": "café", "n": [1, 2]}
    storage.write_bytes(storage.join(base, "rows.jsonl"), storage.json_line({"a": 1}) + b"\n" + storage.json_line({"b": "é"}))
    assert list(storage.iter_jsonl(storage.join(base, "rows.jsonl"))) == [{"a": 1}, {"b": "é"}]


def test_sse_aes256_on_put_and_stream(s3_bucket: str, moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3_SSE", "AES256")
    storage.write_bytes(f"s3://{s3_bucket}/put", b"put\n")
    with storage.open_write(f"s3://{s3_bucket}/stream") as handle:
        handle.write(b"stream\n")
    client = moto_server.client()
    for key in ("put", "stream"):
        head = client.head_object(Bucket=s3_bucket, Key=key)
        if "ServerSideEncryption" in head:  # moto reports it; real S3 does too
            assert head["ServerSideEncryption"] == "AES256"
    assert storage.read_bytes(f"s3://{s3_bucket}/stream") == b"stream\n"

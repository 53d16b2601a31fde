"""The Batch API's audit log (BATCH_API_AUDIT_LOG): `batch-pipeline serve` over a real `dagster dev`,
driven by the openai SDK over HTTP, writing its audit log to a file and, in a second service over the
same instance and storage, to stdout.

Covered: a line per call with its fields (tenant, action, method, path, object id, status, bytes,
duration, client, request id; the request id the caller's X-Request-Id or one made, and returned),
upload, list, retrieve, content, create, cancel and delete each named; a wrong key logged with no
tenant; no prompt, key or metadata text anywhere in the log; concurrent calls each one whole line;
a path whose folder does not exist refused at start naming the variable; every route of the app is
an action the log names, or a probe it leaves out (the app's routes are the log's one table: built
in memory, no server).

The instance is the repo's dagster.yaml with `max_concurrent_runs: 0`: the daemon launches no run,
so created batches stay queued until cancelled and no model is loaded (the runs are not what this
covers; test_batch_api.py runs them).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from batch_pipeline_tests.support.api_service import Serve, client, request_line, serve_env, service_stack
from batch_pipeline_tests.support import REPO

KEY_A, KEY_B = "key-audit-a-0123456789", "key-audit-b-0123456789"
WRONG_KEY = "key-nobody-audit-0123456789"
SECRET = "PROMPT-TEXT-never-in-the-audit-log"
FIELDS = {"time", "request_id", "tenant", "action", "method", "path", "object_id", "status", "bytes", "duration_ms",
          "client"}


@pytest.fixture(scope="module")
def audited(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("audit")
    settings = yaml.safe_load((REPO / "dagster.yaml").read_text())
    settings["concurrency"]["runs"]["max_concurrent_runs"] = 0  # nothing is launched: batches stay queued
    instance_yaml = root / "dagster.yaml"
    instance_yaml.write_text(yaml.safe_dump(settings))
    audit_file = root / "logs" / "audit.jsonl"
    audit_file.parent.mkdir()
    keys = {"BATCH_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B}"}
    with service_stack(root, tiny_model_dir, {**keys, "BATCH_API_AUDIT_LOG": str(audit_file)},
                       instance_yaml=instance_yaml) as stack:
        # A second service over the same instance and storage, its audit log on stdout (kept apart
        # from its log, which is stderr).
        on_stdout = Serve(serve_env({**stack["env"], "BATCH_API_AUDIT_LOG": "-"}), root / "serve-stdout.log",
                          stdout_path=root / "serve-stdout.out")
        try:
            on_stdout.start()
            yield {**stack, "audit": audit_file, "stdout": on_stdout}
        finally:
            on_stdout.stop()


def audit_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def lines_for(path: Path, request_ids: list[str]) -> list[dict[str, Any]]:
    """The audit lines of these requests, in their order (each must be there exactly once)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in audit_lines(path):
        by_id.setdefault(line["request_id"], []).append(line)
    assert all(len(by_id.get(rid, [])) == 1 for rid in request_ids), {rid: by_id.get(rid) for rid in request_ids}
    return [by_id[rid][0] for rid in request_ids]


def session(url: str, request_id: str) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """A tenant's session through the SDK, every call made with its raw response: [(what, response)]
    and the ids made; the upload sends `request_id` as its X-Request-Id. A wrong key and another
    tenant's id along the way."""
    a = client(url, KEY_A).with_raw_response
    calls: list[tuple[str, Any]] = []

    def call(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raw = fn(*args, **kwargs)
        calls.append((what, raw))
        return raw.parse()

    data = ("\n".join([request_line("a-1", SECRET), request_line("a-2", SECRET)]) + "\n").encode()
    uploaded = call("upload", a.files.create, file=("secret.jsonl", data), purpose="batch",
                    extra_headers={"X-Request-Id": request_id})
    call("list", a.files.list)
    call("retrieve", a.files.retrieve, uploaded.id)
    call("content", a.files.content, uploaded.id)
    batch = call("create", a.batches.create, input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                 completion_window="24h", metadata={"note": "metadata-text-not-logged"})
    call("retrieve", a.batches.retrieve, batch.id)
    call("list", a.batches.list)
    call("cancel", a.batches.cancel, batch.id)
    call("delete", a.files.delete, uploaded.id)
    # Refused calls are logged too: a wrong key (401), another tenant's batch (404).
    with pytest.raises(openai.AuthenticationError) as wrong:
        client(url, WRONG_KEY).files.list()
    calls.append(("wrong key", wrong.value.response))
    with pytest.raises(openai.NotFoundError) as other:
        client(url, KEY_B).batches.retrieve(batch.id)
    calls.append(("other tenant", other.value.response))
    return calls, {"file": uploaded.id, "batch": batch.id, "bytes": len(data)}


def check_session(path: Path, calls: list[tuple[str, Any]], ids: dict[str, Any], started: float,
                  request_id: str) -> list[dict[str, Any]]:
    request_ids = [raw.headers["x-request-id"] for _, raw in calls]
    assert request_ids[0] == request_id  # the caller's X-Request-Id, returned
    assert all(rid.startswith("req_") for rid in request_ids[1:]) and len(set(request_ids)) == len(calls)
    lines = lines_for(path, request_ids)
    f, b = ids["file"], ids["batch"]
    assert [(line["tenant"], line["action"], line["method"], line["path"], line["object_id"], line["status"])
            for line in lines] == [
        ("team-a", "upload", "POST", "/v1/files", f, 200),  # a created object's id, from its answer
        ("team-a", "list", "GET", "/v1/files", None, 200),
        ("team-a", "retrieve", "GET", f"/v1/files/{f}", f, 200),
        ("team-a", "content", "GET", f"/v1/files/{f}/content", f, 200),
        ("team-a", "create", "POST", "/v1/batches", b, 200),
        ("team-a", "retrieve", "GET", f"/v1/batches/{b}", b, 200),
        ("team-a", "list", "GET", "/v1/batches", None, 200),
        ("team-a", "cancel", "POST", f"/v1/batches/{b}/cancel", b, 200),
        ("team-a", "delete", "DELETE", f"/v1/files/{f}", f, 200),
        (None, "list", "GET", "/v1/files", None, 401),  # a wrong key: no tenant
        ("team-b", "retrieve", "GET", f"/v1/batches/{b}", b, 404),
    ]
    for line, (_, raw) in zip(lines, calls):
        assert set(line) == FIELDS, line
        assert line["bytes"] == len(raw.content) > 0  # the answer's bytes as the client received them
        assert line["client"] == "127.0.0.1" and isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
        logged_at = dt.datetime.fromisoformat(line["time"].replace("Z", "+00:00")).timestamp()
        assert started - 1 <= logged_at <= time.time()
    assert lines[3]["bytes"] == ids["bytes"]  # content: the file's size, never its text
    text = path.read_text()
    for secret in (SECRET, KEY_A, KEY_B, WRONG_KEY, "metadata-text-not-logged", "say a-1"):
        assert secret not in text, secret
    return lines


def test_every_call_is_one_line_in_the_audit_file(audited):
    started = time.time()
    calls, ids = session(audited["url"], "caller-chosen-id-1")
    check_session(audited["audit"], calls, ids, started, "caller-chosen-id-1")
    # The cancel reached Dagster: the batch's queued run is cancelled.
    assert client(audited["url"], KEY_A).batches.retrieve(ids["batch"]).status in ("cancelling", "cancelled")
    # The service's own log has no secret either.
    assert SECRET not in audited["log"].read_text() and KEY_A not in audited["log"].read_text()


def test_the_audit_log_on_stdout(audited):
    on_stdout = audited["stdout"]
    started = time.time()
    calls, ids = session(f"{on_stdout.base}/v1", "caller-chosen-id-2")
    lines = check_session(on_stdout.stdout_path, calls, ids, started, "caller-chosen-id-2")
    assert len(lines) == len(calls)
    # stdout holds the start-up line and the audit lines, nothing else; and no audit line went to the file.
    out = on_stdout.stdout_path.read_text().splitlines()
    assert out[0].startswith("Batch API on http://") and all(json.loads(line).keys() == FIELDS for line in out[1:])
    assert not {line["request_id"] for line in lines} & {line["request_id"] for line in audit_lines(audited["audit"])}
    assert KEY_A not in on_stdout.log_path.read_text() and SECRET not in on_stdout.log_path.read_text()


def test_concurrent_calls_are_whole_lines(audited):
    before = len(audit_lines(audited["audit"]))
    errors: list[BaseException] = []
    request_ids = [f"concurrent-{i:02d}" for i in range(40)]

    def one(rid: str) -> None:
        try:
            key = KEY_A if int(rid[-2:]) % 2 else KEY_B
            response = httpx.get(f"{audited['url']}/batches", headers={"Authorization": f"Bearer {key}",
                                                                       "X-Request-Id": rid}, timeout=60)
            assert response.status_code == 200 and response.headers["x-request-id"] == rid
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in request_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    lines = lines_for(audited["audit"], request_ids)  # each parses as JSON: none cut or interleaved
    assert [line["tenant"] for line in lines] == ["team-a" if i % 2 else "team-b" for i in range(40)]
    assert len(audit_lines(audited["audit"])) == before + 40
    # An X-Request-Id that is not a plain token (here: with a space) is replaced by one made here.
    response = httpx.get(f"{audited['url']}/batches", headers={"Authorization": f"Bearer {KEY_A}",
                                                               "X-Request-Id": "two words"}, timeout=60)
    assert response.headers["x-request-id"].startswith("req_")
    assert lines_for(audited["audit"], [response.headers["x-request-id"]])[0]["tenant"] == "team-a"


def test_every_route_is_an_action_the_audit_log_names_or_a_probe():
    """The log names a call by the app route it matches (the route's `name=`): a route added without
    one of the documented actions fails here, as would an action no route serves any more."""
    from starlette.routing import Route

    from batch_pipeline.service.app import Service, create_app
    from batch_pipeline.service.audit import ACTIONS, OTHER, UNLOGGED_PATHS, action_of
    from batch_pipeline.service.store import Store

    routes = create_app(Service(Store("/nonexistent"), {"k" * 16: "t"}, "http://127.0.0.1:9")).routes
    unclassified = [(sorted(getattr(r, "methods", None) or []), getattr(r, "path", r), getattr(r, "name", None))
                    for r in routes if not isinstance(r, Route)
                    or (r.path in UNLOGGED_PATHS) == (r.name in ACTIONS)]  # a probe, or else an action: one of them
    assert not unclassified, f"routes the audit log does not classify: {unclassified}"
    assert set(ACTIONS) == {r.name for r in routes if r.path not in UNLOGGED_PATHS}  # no action left without its route
    assert {r.path for r in routes if r.path in UNLOGGED_PATHS} == set(UNLOGGED_PATHS)
    calls = {("POST", "/v1/files"): ("upload", None), ("GET", "/v1/files"): ("list", None),
             ("GET", "/v1/files/file-1"): ("retrieve", "file-1"), ("GET", "/v1/files/file-1/content"): ("content", "file-1"),
             ("DELETE", "/v1/files/file-1"): ("delete", "file-1"), ("POST", "/v1/batches"): ("create", None),
             ("GET", "/v1/batches"): ("list", None), ("GET", "/v1/batches/batch_1"): ("retrieve", "batch_1"),
             ("POST", "/v1/batches/batch_1/cancel"): ("cancel", "batch_1"), ("GET", "/metrics"): ("metrics", None),
             ("PUT", "/v1/files"): (OTHER, None), ("GET", "/v1/nothing"): (OTHER, None),
             ("GET", "/openapi.json"): (OTHER, None), ("GET", "/v1/files/a/b/c"): (OTHER, None)}
    assert {call: action_of(routes, *call) for call in calls} == calls


@pytest.mark.server  # `batch-pipeline serve` in its own process (no fixture says so)
def test_an_audit_log_in_a_missing_folder_is_refused_at_start(tmp_path):
    missing = tmp_path / "no-such-folder" / "audit.jsonl"
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "serve"], capture_output=True,
                          text=True, timeout=120,
                          env=serve_env({"BATCH_API_KEYS": f"team-a:{KEY_A}", "BATCH_API_AUDIT_LOG": str(missing),
                                         "STORAGE_OUTPUT_PATH": str(tmp_path / "out")}))
    assert proc.returncode == 2, proc.stderr
    assert f"BATCH_API_AUDIT_LOG={missing}: the folder {missing.parent} does not exist" in proc.stderr
    assert not missing.parent.exists()

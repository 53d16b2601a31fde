"""The Batch API service (`batch-pipeline serve`) driven by the unmodified openai SDK, over HTTP,
against a real `dagster dev` (web server, daemon) and real vLLM on the tiny model.

The whole lifecycle (upload, create, poll, read the output and error files, list), a bad line in an
otherwise good file, a file that is not JSONL, a wrong purpose, a file over the request limit, two
tenants kept apart, a wrong key, cancel mid-run, /ready and /metrics, a tenant's limit of batches in
flight (429), files and batch outputs expiring, the service SIGKILLed mid-batch and started again.
The module's Dagster runs on the production instance settings (deploy/dagster.yaml: PostgreSQL, queued
runs, run retries and monitoring) when PostgreSQL is reachable. The lifecycle test then reads the
batch's run from PostgreSQL with plain SQL, and the kill test also SIGKILLs the run worker doing the
inference: the code server fails that run, the run-retry daemon re-launches it from the failed step
once the monitoring daemon has freed the dead run's "gpu" slot, the retry resumes from the
checkpoints, and the service follows it to the end; with the service up, a batch polled every 0.2 s
from its run worker's kill to the end is never terminal before `completed`. Without the module's Dagster: TLS with a
self-signed certificate, the limit settings. The 2 s window test's batch is created as the service
comes up, so that its run (no model) is done beside the lifecycle's instead of on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from batch_pipeline_tests.support import api_service
from batch_pipeline_tests.support.cli_runs import jsonl_records
from batch_pipeline_tests.support import TINY_NAME
from batch_pipeline_tests.support.dagster_server import free_port, pipeline_env, start_dagster_dev
from batch_pipeline_tests.support import REPO, wait_for
from batch_pipeline_tests.support.postgres_db import PG_HOST, PG_PASSWORD, PG_PORT, PG_USER, connect, fresh_database, reachable

KEY_A, KEY_B, KEY_C = "key-team-a-0123456789", "key-team-b-0123456789", "key-team-c-0123456789"
RUN_TIMEOUT = 300.0  # create to completed: the daemon's queue, a model load and a few answers on 2 loaded cores
TERMINAL = ("completed", "failed", "expired", "cancelled")


def request_line(custom_id: str) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"say {custom_id}"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


class Serve:
    """One `batch-pipeline serve` at a time on a fixed port: `kill()` (SIGKILL, no shutdown code runs)
    and `start()` again give a new process over the same storage and Dagster instance."""

    def __init__(self, env: dict[str, str], log_path: Path, *args: str, scheme: str = "http",
                 context: ssl.SSLContext | None = None) -> None:
        self.env, self.log_path, self.args, self.scheme, self.context = env, log_path, args, scheme, context
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def start(self) -> "Serve":
        with open(self.log_path, "ab") as log:  # appended: a restarted service's lines follow the first's
            self.process = subprocess.Popen(
                [str(Path(sys.executable).with_name("batch-pipeline")), "serve", "--port", str(self.port), *self.args],
                cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("batch-pipeline serve healthy", self._healthy, 60, interval=0.5)
        return self

    def _healthy(self) -> bool | None:
        if self.process.poll() is not None:
            raise RuntimeError(f"batch-pipeline serve exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=2, context=self.context) as r:
                return r.status == 200 or None
        except OSError:
            return None

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


def serve_env(extra: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with `extra` added (None: unset)."""
    merged = {**os.environ, **extra}
    return {k: v for k, v in merged.items() if v is not None}


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The service over a `dagster dev` with the production instance settings (deploy/dagster.yaml:
    PostgreSQL, queued runs, run retries and monitoring) on a fresh database; on the local SQLite
    instance (the repo's dagster.yaml) when nothing listens on 127.0.0.1:5432."""
    root = tmp_path_factory.mktemp("batch_api")
    inbox, out = root / "in", root / "out"
    inbox.mkdir()
    with contextlib.ExitStack() as stack:
        pg: dict[str, str] = {}
        if reachable() is None:
            pg = {"DAGSTER_POSTGRES_USER": PG_USER, "DAGSTER_POSTGRES_PASSWORD": PG_PASSWORD,
                  "DAGSTER_POSTGRES_HOSTNAME": PG_HOST, "DAGSTER_POSTGRES_PORT": str(PG_PORT),
                  "DAGSTER_POSTGRES_DB": stack.enter_context(fresh_database("batch_pipeline_api"))}
        # Checkpoint parts every second: the cancel test sees answers coming in well before the end.
        # The runs go to the test run's warm engine 4 requests at a time (ENGINE_WINDOW), as a run fed
        # to a shared server in small bites: the long batches that are cancelled and killed mid-way
        # then last some seconds (all at once, a warm engine answered 160 of them within a second).
        env = {**pg, **pipeline_env(tiny_model_dir, str(inbox), str(out), warm_engine_url, CHECKPOINT_SECONDS="1",
                                    ENGINE_WINDOW="4")}
        # The monitoring daemon looks every 2 s rather than deploy/'s 10, and gives a dead run's pool
        # slot back 3 s after its end rather than 15: the kill tests' retries wait on both.
        quicker = {"run_monitoring": {"poll_interval_seconds": 2, "free_slots_after_run_end_seconds": 3}}
        server = start_dagster_dev(root / "home", env, root / "dagster-dev.log",
                                   instance_yaml=REPO / "deploy" / "dagster.yaml" if pg else None,
                                   overrides=quicker if pg else None)
        stack.callback(server.stop)
        api = Serve(serve_env({**env, "DAGSTER_HOME": str(root / "home"), "DAGSTER_WEBSERVER_URL": server.url,
                               "BATCH_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B},team-c:{KEY_C}",
                               # team-c may have one batch in flight; expiries down to 1 s (tests only);
                               # a 2 s completion window an operator allowed (the expiry test's).
                               "BATCH_API_TENANT_LIMITS": "team-c:1", "BATCH_API_MIN_EXPIRY_SECONDS": "1",
                               "BATCH_API_COMPLETION_WINDOWS": "2s",
                               "BATCH_API_MAX_FILE_REQUESTS": "1000", "BATCH_API_MAX_FILE_BYTES": str(2 * 2**20)}),
                    root / "serve.log")
        stack.callback(api.stop)
        api.start()
        yield {"url": f"{api.base}/v1", "server": server, "out": out, "log": api.log_path, "serve": api,
               "database": pg.get("DAGSTER_POSTGRES_DB"), "late": late_batch(f"{api.base}/v1")}


LATE_IDS = [f"late-{i}" for i in range(3)]


def late_batch(url: str) -> Any:
    """test_a_batch_not_done_in_its_window_expires's batch (team B, a 2 s window), created as soon as
    the service is up: its run, which loads no model, comes and goes beside the next tests' runs
    instead of costing a run's start of its own later (~18 s on 2 loaded cores). Team B: the
    lifecycle test lists team A's batches."""
    sdk = api_service.client(url, KEY_B)
    uploaded = sdk.files.create(file=("late.jsonl", ("\n".join(request_line(i) for i in LATE_IDS) + "\n").encode()),
                                purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="2s")


def client(service: dict[str, Any], key: str = KEY_A) -> openai.OpenAI:
    return api_service.client(service["url"], key)




def finished(sdk: openai.OpenAI, batch_id: str, server: Any) -> Any:
    def done() -> Any:
        batch = sdk.batches.retrieve(batch_id)
        return batch if batch.status in TERMINAL else None

    return wait_for(f"batch {batch_id} finished", done, RUN_TIMEOUT, interval=2.0, on_timeout=server.log_tail)


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert.pem, key.pem)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.mark.server  # `batch-pipeline serve` in its own process (no fixture says so)
def test_serve_speaks_tls_with_the_given_certificate(tmp_path):
    # No Dagster here: /health and the Files paths need only the storage.
    cert, key = self_signed_cert(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    api = Serve(serve_env({"BATCH_API_KEYS": f"team-a:{KEY_A}", "STORAGE_OUTPUT_PATH": str(tmp_path / "out"),
                           "DAGSTER_WEBSERVER_URL": "http://127.0.0.1:9"}),
                tmp_path / "serve.log", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                scheme="https", context=trusted)
    try:
        api.start()  # healthy: GET https://127.0.0.1:<port>/health answered 200, verified against the certificate
        with urllib.request.urlopen(f"{api.base}/health", timeout=10, context=trusted) as response:
            assert json.loads(response.read()) == {"status": "ok"}
        # The SDK over TLS, trusting only that certificate.
        import httpx

        sdk = openai.OpenAI(base_url=f"{api.base}/v1", api_key=KEY_A, max_retries=0,
                            http_client=httpx.Client(verify=trusted))
        uploaded = sdk.files.create(file=("t.jsonl", request_line("tls").encode()), purpose="batch")
        assert [f.id for f in sdk.files.list().data] == [uploaded.id]
        sdk.close()
        # A client that does not trust the certificate is refused by its own TLS check.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"{api.base}/health", timeout=10, context=ssl.create_default_context())
        assert "Batch API on https://" in api.log_path.read_text()
    finally:
        api.stop()


def test_the_whole_lifecycle_with_the_openai_sdk(service):
    sdk = client(service)
    good = [f"req-{i}" for i in range(1, 5)]
    lines = [request_line(i) for i in good]
    lines.insert(2, '{"custom_id": "broken", "method": "POST", ')  # line 3 is not JSON
    lines.append(json.dumps({"custom_id": "other-url", "method": "POST", "url": "/v1/embeddings",  # line 6
                             "body": {"model": TINY_NAME, "input": "x"}}))
    uploaded = sdk.files.create(file=("nightly.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.filename == "nightly.jsonl" and uploaded.id.startswith("file-")
    assert sdk.files.retrieve(uploaded.id).bytes == uploaded.bytes

    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly-feedback"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly-feedback"}
    # The run is Dagster's own, tagged with the batch and the tenant.
    runs = service["server"].graphql(
        """query($f: RunsFilter) { runsOrError(filter: $f) { ... on Runs { results { runId jobName tags { key value } } } } }""",
        {"f": {"tags": [{"key": "batch_pipeline/api_batch_id", "value": batch.id}]}})["runsOrError"]["results"]
    assert len(runs) == 1 and runs[0]["jobName"] == "batch_job"
    assert {"key": "batch_pipeline/tenant", "value": "team-a"} in runs[0]["tags"]

    done = finished(sdk, batch.id, service["server"])
    assert done.status == "completed", (done, service["server"].log_tail())
    assert done.request_counts.total == 6 and done.request_counts.completed == 4 and done.request_counts.failed == 2
    assert done.input_file_id == uploaded.id and done.usage.output_tokens > 0
    outputs = jsonl_records(sdk.files.content(done.output_file_id).text)
    errors = jsonl_records(sdk.files.content(done.error_file_id).text)
    assert sorted(o["custom_id"] for o in outputs) == good
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    # A line whose url is not the batch's endpoint is an error line (OpenAI's code), not run.
    assert [(e["error"]["code"], e["error"]["line"]) for e in errors] == [("invalid_json", 3), ("url_mismatch", 6)]
    assert [b.id for b in sdk.batches.list().data] == [batch.id]
    # The results are where the pipeline puts a date's batches.
    assert len(list(service["out"].glob(f"????-??-??/{batch.id}/batch.json"))) == 1
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        sdk.batches.cancel(batch.id)
    # Nothing of the requests or answers is in the service's log.
    assert "say req-1" not in service["log"].read_text()
    if service["database"]:
        # The run, with the batch's tag, is in PostgreSQL's runs table, read with plain SQL (SUCCESS
        # once the run worker has finished its last step, shortly after it wrote the Batch object).
        conn = connect(service["database"])

        def run_statuses() -> list[tuple[str]] | None:
            with conn.cursor() as cur:
                cur.execute("SELECT r.status FROM runs r JOIN run_tags t ON t.run_id = r.run_id "
                            "WHERE t.key = 'batch_pipeline/api_batch_id' AND t.value = %s", (batch.id,))
                rows = cur.fetchall()
            return rows if rows != [("STARTED",)] else None

        try:
            assert wait_for("the run finished", run_statuses, 120, interval=1.0) == [("SUCCESS",)]
        finally:
            conn.close()


def test_bad_uploads_are_refused_with_the_reason(service):
    sdk = client(service)
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not served here"):
        sdk.files.create(file=("x.jsonl", request_line("a").encode()), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="not JSONL"):
        sdk.files.create(file=("x.pdf", b"%PDF-1.7 binary stuff\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window '1h' is not allowed here: '24h'"):
        uploaded = sdk.files.create(file=("x.jsonl", request_line("a").encode()), purpose="batch")
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/images' is not one of"):
        sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/images", completion_window="24h")


def test_tenants_are_kept_apart_and_a_wrong_key_is_refused(service):
    a, b = client(service, KEY_A), client(service, KEY_B)
    uploaded = a.files.create(file=("mine.jsonl", request_line("x").encode()), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert uploaded.id not in [f.id for f in b.files.list().data] and uploaded.id in [f.id for f in a.files.list().data]
    with pytest.raises(openai.AuthenticationError):
        client(service, "key-nobody-0123456789").files.list()
    assert b.files.delete(b.files.create(file=("t.jsonl", request_line("y").encode()), purpose="batch").id).deleted


def test_a_file_over_the_limits_is_refused_at_upload(service):
    """The limits (OpenAI's 200 MB and 50,000 requests by default) set lower for this service:
    BATCH_API_MAX_FILE_REQUESTS=1000, BATCH_API_MAX_FILE_BYTES=2 MiB."""
    sdk = client(service)
    many = ("\n".join(request_line(str(i)) for i in range(1001)) + "\n").encode()
    with pytest.raises(openai.BadRequestError, match="the file has 1001 requests, over the limit of 1000"):
        sdk.files.create(file=("many.jsonl", many), purpose="batch")
    padded = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": "x" * 2**21}]}})
    with pytest.raises(openai.BadRequestError, match=r"the file is \d+ bytes, over the limit of 2097152"):
        sdk.files.create(file=("big.jsonl", padded.encode()), purpose="batch")
    assert sdk.files.create(file=("fits.jsonl", many.rsplit(b"\n", 2)[0] + b"\n"), purpose="batch").bytes < len(many)


def test_cancel_mid_run_keeps_the_answers_and_reports_the_rest_cancelled(service):
    sdk = client(service)
    # ~160k tokens, tens of seconds on the tiny model here; the first 8 lines want 2 tokens each, so
    # answers are checkpointed (every second here) right after the first steps: cancelled early.
    ids = [f"c-{i}" for i in range(800)]
    body = lambda n: {"model": TINY_NAME, "messages": [{"role": "user", "content": f"count {n}"}],  # noqa: E731
                      "max_tokens": 2 if n < 8 else 200, "ignore_eos": True}
    lines = [json.dumps({"custom_id": i, "method": "POST", "url": "/v1/chat/completions", "body": body(n)})
             for n, i in enumerate(ids)]
    uploaded = sdk.files.create(file=("long.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    # Live counts while it runs: cancel once answers are coming in.
    running = wait_for("answers checkpointed", lambda: (b := sdk.batches.retrieve(batch.id)).request_counts.completed
                       and b, RUN_TIMEOUT, interval=0.5, on_timeout=service["server"].log_tail)
    assert running.status == "in_progress" and running.request_counts.total == len(ids)
    assert 0 < running.request_counts.completed < len(ids)
    cancelling = sdk.batches.cancel(batch.id)
    # "cancelling"; or already "cancelled" when the run stopped before the answer was made (a loaded
    # machine can cancel it within the same second).
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at, cancelling
    done = finished(sdk, batch.id, service["server"])
    assert done.status == "cancelled", done
    outputs = jsonl_records(sdk.files.content(done.output_file_id).text)
    errors = jsonl_records(sdk.files.content(done.error_file_id).text)
    assert sorted(r["custom_id"] for r in outputs + errors) == sorted(ids)  # every line once: nothing lost
    assert errors and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert done.request_counts.completed == len(outputs) and done.request_counts.failed == len(errors)


def test_a_batch_not_done_in_its_window_expires(service):
    """A window the operator allowed (BATCH_API_COMPLETION_WINDOWS=2s, shorter than a run takes to
    start): the run keeps the deadline itself, loads no model and reports every line batch_expired.
    (Team B's batch, created with the service by its fixture: late_batch.)"""
    sdk = client(service, KEY_B)
    ids, batch = LATE_IDS, service["late"]
    assert batch.completion_window == "2s" and batch.expires_at == batch.created_at + 2
    done = finished(sdk, batch.id, service["server"])
    assert done.status == "expired" and done.expired_at >= done.expires_at, done
    assert done.request_counts.total == 3 and done.request_counts.completed == 0 and done.request_counts.failed == 3
    errors = jsonl_records(sdk.files.content(done.error_file_id).text)
    assert sorted(e["custom_id"] for e in errors) == ids and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert sdk.files.content(done.output_file_id).text == ""


def test_an_idle_kept_alive_connection_is_still_served_after_the_clients_own_expiry(service):
    """The openai SDK keeps an idle connection 5 s; the service keeps it longer, so a client never
    sends on a connection the server is closing at that very moment (a "connection reset")."""
    import http.client
    from urllib.parse import urlsplit

    from batch_pipeline.cli.main import KEEP_ALIVE_SECONDS

    assert KEEP_ALIVE_SECONDS > 5
    parts = urlsplit(service["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        for attempt in range(2):
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and not response.will_close
            response.read()
            if attempt == 0:
                time.sleep(6)  # the scenario: idle past both sides' old 5 s, on the same connection
                assert conn.sock is not None
    finally:
        conn.close()


def test_ready_and_metrics(service):
    import re
    import urllib.error
    import urllib.request

    base = service["url"].removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/ready", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ready"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/metrics", timeout=10)
    assert refused.value.code == 401
    request = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY_B}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    gauges = {m[0]: int(m[1]) for m in re.findall(r'^batch_pipeline_api_batches\{status="(\w+)"\} (\d+)$', text, re.M)}
    batches = sum(len(client(service, key).batches.list(limit=100).data) for key in (KEY_A, KEY_B, KEY_C))
    assert sum(gauges.values()) == batches  # every tenant's batches, each counted once by its status
    assert re.search(r"^batch_pipeline_api_files \d+$", text, re.M) and "say req" not in text
    queued = service["server"].graphql("{ runsOrError(filter: {statuses: [QUEUED]}) { ... on Runs { count } } }")
    assert f"\nbatch_pipeline_api_queued_runs {queued['runsOrError']['count']}\n" in text
    # The oldest queued run's age, from the real web server's creation times (0 with none queued).
    age = float(re.search(r"^batch_pipeline_api_oldest_queued_run_age_seconds (\S+)$", text, re.M).group(1))
    assert age >= 0 and (age > 0) == (queued["runsOrError"]["count"] > 0)

    # Not ready: the Dagster web server is not there (the service's own check, in-process).
    from fastapi.testclient import TestClient

    from batch_pipeline.service.app import Service, create_app
    from batch_pipeline.service.store import Store

    down = TestClient(create_app(Service(Store(str(service["out"])), {KEY_A: "team-a"}, "http://127.0.0.1:9")))
    response = down.get("/ready")
    assert response.status_code == 503 and "Dagster web server http://127.0.0.1:9" in response.json()["problems"][0]


def test_limit_settings_are_checked_naming_the_variable(tmp_path):
    import re

    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.service.app import completion_windows, load_limits, min_expiry_seconds

    tenants = {"team-a", "team-b"}
    assert load_limits(tenants, {}) == (None, {})
    assert load_limits(tenants, {"BATCH_API_MAX_IN_FLIGHT": "4", "BATCH_API_TENANT_LIMITS": "team-a:2, team-b:none"}) \
        == (4, {"team-a": 2, "team-b": None})
    for env, message in [({"BATCH_API_MAX_IN_FLIGHT": "0"}, "BATCH_API_MAX_IN_FLIGHT='0' is out of range (at least 1)"),
                         ({"BATCH_API_TENANT_LIMITS": "team-a"}, "BATCH_API_TENANT_LIMITS: 'team-a' is not tenant:limit"),
                         ({"BATCH_API_TENANT_LIMITS": "team-x:2"}, "BATCH_API_TENANT_LIMITS: tenant 'team-x' has no API key"),
                         ({"BATCH_API_TENANT_LIMITS": "team-a:many"}, "BATCH_API_TENANT_LIMITS (team-a)='many'")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_limits(tenants, env)
    assert min_expiry_seconds({}) == 3600 and min_expiry_seconds({"BATCH_API_MIN_EXPIRY_SECONDS": "5"}) == 5
    with pytest.raises(ConfigError, match="BATCH_API_MIN_EXPIRY_SECONDS='-1'"):
        min_expiry_seconds({"BATCH_API_MIN_EXPIRY_SECONDS": "-1"})
    assert completion_windows({}) == {"24h": 86400}
    assert completion_windows({"BATCH_API_COMPLETION_WINDOWS": "1h, 90s,7d"}) == {"24h": 86400, "1h": 3600, "90s": 90,
                                                                                  "7d": 604800}
    for bad in ("0h", "1 week", "24"):
        with pytest.raises(ConfigError, match=re.escape(f"BATCH_API_COMPLETION_WINDOWS: {bad!r} is not a duration")):
            completion_windows({"BATCH_API_COMPLETION_WINDOWS": bad})
    # The command refuses to start, naming the variable.
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "serve"], capture_output=True, text=True,
                          env=serve_env({"BATCH_API_KEYS": f"team-a:{KEY_A}", "BATCH_API_MAX_IN_FLIGHT": "lots",
                                         "STORAGE_OUTPUT_PATH": str(tmp_path)}), timeout=120)
    assert proc.returncode == 2 and "BATCH_API_MAX_IN_FLIGHT='lots'" in proc.stderr, proc.stderr


def test_a_tenant_at_its_limit_of_batches_in_flight_gets_429(service):
    sdk = client(service, KEY_C)  # BATCH_API_TENANT_LIMITS=team-c:1
    # Long enough that it cannot end on its own before its cancel below is carried out (a one-line
    # batch once did, on a loaded machine): a cancelled run stops at its next answer (defs/run_watch.py).
    lines = [api_service.request_line(f"lim-{i}", max_tokens=256) for i in range(400)]
    uploaded = sdk.files.create(file=("long.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    create = lambda: sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",  # noqa: E731
                                        completion_window="24h")
    first = create()
    with pytest.raises(openai.RateLimitError, match="too many batches in flight: this tenant may have 1 unfinished") as refused:
        create()
    assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.type == "requests"  # OpenAI's type for a request-count limit
    assert [b.id for b in sdk.batches.list().data] == [first.id]  # the refused one left no record and no run
    # Once the first is finished (cancelled here: cheaper than answering), the next one is taken.
    sdk.batches.cancel(first.id)
    assert finished(sdk, first.id, service["server"]).status == "cancelled"
    second = create()
    assert second.status in ("validating", "in_progress")
    sdk.batches.cancel(second.id)


def test_files_and_batch_outputs_expire_and_are_deleted(service):
    import time

    sdk = client(service, KEY_B)
    data = request_line("exp").encode()
    short = sdk.files.create(file=("short.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 2})
    kept = sdk.files.create(file=("kept.jsonl", data), purpose="batch")
    assert short.expires_at == short.created_at + 2 and kept.expires_at is None
    with pytest.raises(openai.BadRequestError, match="from 1 to 2592000") as refused:
        sdk.files.create(file=("x.jsonl", data), purpose="batch", expires_after={"anchor": "created_at", "seconds": 2592001})
    assert refused.value.param == "expires_after.seconds"
    with pytest.raises(openai.BadRequestError, match="only 'created_at'") as refused:
        sdk.files.create(file=("x.jsonl", data), purpose="batch", expires_after={"anchor": "last_active_at", "seconds": 60})
    assert refused.value.param == "expires_after.anchor"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h",
                           output_expires_after={"anchor": "created_at", "seconds": 0})
    assert refused.value.param == "output_expires_after.seconds"
    batch = sdk.batches.create(input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h",
                               output_expires_after={"anchor": "created_at", "seconds": 8})

    stored = service["out"] / "_batch_api" / "files" / f"{short.id}.jsonl"
    assert stored.exists()
    time.sleep(max(0.0, short.expires_at + 1 - time.time()))
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(short.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(short.id)
    assert short.id not in [f.id for f in sdk.files.list().data] and kept.id in [f.id for f in sdk.files.list().data]
    assert not stored.exists()  # the content is gone from storage, not only hidden

    done = finished(sdk, batch.id, service["server"])
    assert done.status == "completed", done
    output = sdk.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 8 and output.created_at >= batch.created_at
    assert json.loads(sdk.files.content(done.output_file_id).text.split("\n")[0])["custom_id"] == "exp"
    (written,) = service["out"].glob(f"????-??-??/{batch.id}/output.jsonl")
    time.sleep(max(0.0, output.expires_at + 1 - time.time()))
    for file_id in (done.output_file_id, done.error_file_id):
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(file_id)
    assert not written.exists() and not written.with_name("errors.jsonl").exists()
    assert sdk.batches.retrieve(batch.id).output_file_id == done.output_file_id  # the batch keeps its record


def batch_runs(server: Any, batch_id: str) -> list[dict[str, Any]]:
    """The Dagster runs of an API batch, newest first, with their tags and log messages."""
    runs = server.graphql(
        """query($f: RunsFilter) { runsOrError(filter: $f) { ... on Runs { results { runId status tags { key value } } } } }""",
        {"f": {"tags": [{"key": "batch_pipeline/api_batch_id", "value": batch_id}]}})["runsOrError"]["results"]
    for run in runs:
        run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
        events = server.graphql(
            """query($id: ID!) { logsForRun(runId: $id) { ... on EventConnection { events { ... on MessageEvent { message } } } } }""",
            {"id": run["runId"]})["logsForRun"]["events"]
        run["messages"] = [e.get("message") or "" for e in events]
    return runs


def long_batch(sdk: openai.OpenAI, service: dict[str, Any], case: str, n: int = 200) -> tuple[Any, Any, list[str], Any]:
    """(the upload, the batch, its custom ids, a function listing its checkpoint parts) of a batch of
    `n` staggered lines (ignore_eos: exactly max_tokens each), so answers finish one by one and
    checkpoint parts appear while most are still being answered; once its first part is written."""
    ids = [f"{case[0]}-{i:03d}" for i in range(n)]
    body = lambda i: {"model": TINY_NAME, "messages": [{"role": "user", "content": f"go {ids[i]}"}],  # noqa: E731
                      "max_tokens": 16 + i, "ignore_eos": True}
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body(i)})
             for i, c in enumerate(ids)]
    uploaded = sdk.files.create(file=(f"{case}.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"case": case})
    parts = lambda: list(service["out"].glob(f"????-??-??/{batch.id}/_work/answers/*/part-*.jsonl"))  # noqa: E731
    wait_for("the first checkpoint part", parts, RUN_TIMEOUT, interval=0.1, on_timeout=service["server"].log_tail)
    return uploaded, batch, ids, parts


def kill_run_worker(server: Any, batch_id: str) -> dict[str, Any]:
    """SIGKILL the process answering the batch (its run's worker: the in-process executor runs every
    step there); the run, as batch_runs gives it."""
    [first] = batch_runs(server, batch_id)
    [pid] = [int(m.split("pid: ")[1].rstrip(").")) for m in first["messages"] if m.startswith("Started process for run (pid: ")]
    os.kill(pid, signal.SIGKILL)
    return first


def check_the_retry(server: Any, batch_id: str, first: dict[str, Any], done_at_kill: int, total: int) -> dict[str, Any]:
    """The killed run failed (the code server saw its worker die) with Dagster's decision to retry it,
    and its retry (run_retries; on the warm engine no "gpu" pool slot is held, so the queue starts it
    as soon as the daemon launches it) finished
    and resumed from the killed attempt's checkpoints: reused at least what was written at the kill."""
    # (SUCCESS once its run worker has finished its last step, shortly after it wrote the Batch object)
    retry, killed = wait_for("the retry run finished", lambda: (runs := batch_runs(server, batch_id))[0]["status"] != "STARTED"
                             and runs, 120, interval=1.0, on_timeout=server.log_tail)
    assert killed["runId"] == first["runId"] and killed["status"] == "FAILURE", killed["status"]
    assert killed["tags"]["dagster/will_retry"] == "true"
    assert any("terminated by signal 9" in m for m in killed["messages"]), killed["messages"][-10:]
    assert retry["status"] == "SUCCESS" and retry["tags"]["dagster/retry_number"] == "1", retry["status"]
    assert retry["tags"]["dagster/parent_run_id"] == first["runId"]
    [resuming] = [m for m in retry["messages"] if "requests already answered; resuming" in m]
    reused = int(resuming.split(": ", 1)[1].split(" of ")[0])
    assert 0 < done_at_kill <= reused < total and f" of {total} requests" in resuming, (done_at_kill, resuming)
    return retry


def test_the_service_and_the_run_killed_mid_batch_keep_every_record(service):
    """The service SIGKILLed mid-batch and started again. On the production instance settings
    (PostgreSQL, run retries) the run worker doing the inference is SIGKILLed at the same moment:
    Dagster fails that run and retries it, the retry resumes from the checkpoints, and the service
    follows the retry (the batch is never reported failed)."""
    sdk, server = client(service), service["server"]
    retried = bool(service["database"])  # the local SQLite instance (no PostgreSQL here) has no run retries
    uploaded, batch, ids, parts = long_batch(sdk, service, "restart")
    api = service["serve"]
    api.kill()  # SIGKILL: no shutdown code of the service runs
    first = kill_run_worker(server, batch.id) if retried else None
    done_at_kill = sum(p.read_text().count("\n") for p in parts())
    assert done_at_kill < len(ids), "the batch was answered before the kill: make it longer"
    with pytest.raises(openai.APIConnectionError):
        sdk.batches.retrieve(batch.id)
    api.start()  # a new process on the same storage and instance
    assert service["log"].read_text().count("Batch API on http://") >= 2
    again = sdk.files.retrieve(uploaded.id)
    assert (again.bytes, again.filename) == (uploaded.bytes, "restart.jsonl")
    resumed = sdk.batches.retrieve(batch.id)
    assert resumed.metadata == {"case": "restart"}
    assert resumed.status == "in_progress", resumed  # the batch went on without the service
    assert batch.id in [b.id for b in sdk.batches.list(limit=100).data]
    seen = set()

    def done() -> Any:
        now = sdk.batches.retrieve(batch.id)
        seen.add(now.status)
        return now if now.status in TERMINAL else None

    done = wait_for(f"batch {batch.id} finished", done, RUN_TIMEOUT, interval=1.0, on_timeout=server.log_tail)
    assert done.status == "completed" and seen <= {"in_progress", "finalizing", "completed"}, (seen, done)
    assert done.request_counts.total == len(ids) and done.request_counts.completed == len(ids)
    outputs = jsonl_records(sdk.files.content(done.output_file_id).text)
    assert sorted(o["custom_id"] for o in outputs) == sorted(ids)  # every line answered once
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    if not retried:
        return
    retry = check_the_retry(server, batch.id, first, done_at_kill, len(ids))
    [written] = service["out"].glob(f"????-??-??/{batch.id}/batch.json")
    assert json.loads(written.read_text())["metadata"]["dagster_run_id"] == retry["runId"]
    # The same facts straight from PostgreSQL: both runs, and one materialization of the results, the retry's.
    conn = connect(service["database"])
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT r.run_id, r.status FROM runs r JOIN run_tags t ON t.run_id = r.run_id "
                        "WHERE t.key = 'batch_pipeline/api_batch_id' AND t.value = %s", (batch.id,))
            assert dict(cur.fetchall()) == {first["runId"]: "FAILURE", retry["runId"]: "SUCCESS"}
            cur.execute("SELECT run_id FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'"
                        " AND asset_key = %s AND run_id IN (%s, %s)", (json.dumps(["batch_outputs"]), first["runId"], retry["runId"]))
            assert [r[0] for r in cur.fetchall()] == [retry["runId"]]
    finally:
        conn.close()


def test_a_batch_whose_run_worker_is_killed_is_never_reported_over_before_completed(service):
    """The run worker alone SIGKILLed, the service up: polled every 0.2 s from the kill to the end,
    the batch is never terminal before `completed`, through Dagster's failure of the run, its retry
    decision, the wait for the retry's turn and the retry itself; every line is answered once, some
    reused from the killed run. (The window between the failure and the decision is milliseconds
    here: test_service_retries.py holds it open with a stand-in, for the Batch object and /metrics.)"""
    if not service["database"]:
        pytest.skip("run retries are the production instance's (PostgreSQL); none reachable here")
    sdk, server = client(service), service["server"]
    _, batch, ids, parts = long_batch(sdk, service, "watched", n=160)
    first = kill_run_worker(server, batch.id)
    done_at_kill = sum(p.read_text().count("\n") for p in parts())
    assert done_at_kill < len(ids), "the batch was answered before the kill: make it longer"
    seen: list[str] = []  # the batch's status at each look

    def look() -> Any:
        now = sdk.batches.retrieve(batch.id)
        seen.append(now.status)
        return now if now.status in TERMINAL else None

    done = wait_for(f"batch {batch.id} finished", look, RUN_TIMEOUT, interval=0.2, on_timeout=server.log_tail)
    assert done.status == "completed" and set(seen[:-1]) <= {"in_progress", "finalizing"}, seen
    assert len(seen) > 50, len(seen)  # looked all through the kill, the retry's wait and its answers
    assert done.request_counts.total == done.request_counts.completed == len(ids)
    outputs = jsonl_records(sdk.files.content(done.output_file_id).text)
    assert sorted(o["custom_id"] for o in outputs) == sorted(ids)  # every line answered once
    check_the_retry(server, batch.id, first, done_at_kill, len(ids))

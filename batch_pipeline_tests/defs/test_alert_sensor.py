"""Tests for `run_failure_alert_sensor` (defs/alerts.py): a failed run POSTed to ALERT_WEBHOOK_URL.

Covers: a real failed run (`dg.materialize` of a daily-partitioned asset on an ephemeral instance,
tagged as a Batch API run, raising an error whose message and cause quote a prompt) driven through the
sensor with Dagster's public testing API (`build_run_status_sensor_context(...).for_run_failure()`),
against a real HTTP receiver (http.server in a thread): the payload's fields (run, job, partition,
batch, tenant, failure reason, failed step, error class and cause classes), no user text anywhere in
what is sent, the idempotency key; off while the variable is unset; a malformed URL refused naming
the variable without echoing it; retries on 503 then delivery, no retry on 400, a receiver that is
down or too slow dropped within a bounded time (never an exception out of the sensor), and one
attempt per alert right after a drop; the sensor is among the definitions, running by default.

Does not start a Dagster daemon or web server: the sensor function is invoked as Dagster's testing
API documents; evaluation by a daemon is Dagster's own.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.base.errors import ConfigError
from batch_pipeline.defs import alerts
from batch_pipeline.defs.partitions import daily_partitions

PROMPT = "My card number is 4111 1111 1111 1111, please summarise my medical file"
ANSWER = "Patient shows signs of"
TAGS = {"batch_pipeline/api_batch_id": "batch_0123456789abcdef01234567", "batch_pipeline/tenant": "team-a",
        "batch_pipeline/trigger": "batch api", "batch_pipeline/batch_name": "batch_0123456789abcdef01234567"}


class Receiver:
    """A real HTTP server recording each POST; `plan` is the status of each answer in turn (then 200)."""

    def __init__(self, plan: list[int] | None = None, delay: float = 0.0) -> None:
        self.plan, self.delay, self.requests = list(plan or []), delay, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if receiver.delay:
                    time.sleep(receiver.delay)  # the scenario: a receiver deliberately slow to answer
                status = receiver.plan.pop(0) if receiver.plan else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/batch?token=abc123"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(plan: list[int] | None = None, delay: float = 0.0) -> Receiver:
        made.append(Receiver(plan, delay))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture(autouse=True)
def fast_delivery(monkeypatch):
    monkeypatch.setattr(alerts, "TIMEOUT_SECONDS", 0.5)
    monkeypatch.setattr(alerts, "BACKOFF_SECONDS", (0.05, 0.1))
    monkeypatch.setattr(alerts, "_degraded_until", 0.0)
    monkeypatch.delenv("ALERT_WEBHOOK_URL", raising=False)


@dg.asset(partitions_def=daily_partitions)
def inference_results() -> None:
    """Fails as a step inside an engine might: the message and the cause quote a prompt and an answer."""
    try:
        raise KeyError(f"no parser for {ANSWER!r}")
    except KeyError as e:
        raise ValueError(f"the model choked on {PROMPT!r}") from e


@pytest.fixture(scope="module")
def failed_run():
    """(instance, the failed run, its run failure event): a real run of a real instance."""
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([inference_results], instance=instance, partition_key="2026-12-01", tags=TAGS,
                            raise_on_error=False)
    assert not result.success
    return instance, result.dagster_run, result.get_run_failure_event()


def sensor_context(failed_run) -> dg.RunFailureSensorContext:
    instance, run, event = failed_run
    return dg.build_run_status_sensor_context(sensor_name="run_failure_alert_sensor", dagster_event=event,
                                              dagster_instance=instance, dagster_run=run).for_run_failure()


def test_unset_means_off(failed_run, receiver):
    r = receiver()
    result = alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert isinstance(result, dg.SkipReason) and "ALERT_WEBHOOK_URL is not set" in result.skip_message
    assert r.requests == []


def test_a_failed_run_is_posted_with_its_run_batch_and_step_and_no_user_text(failed_run, receiver, monkeypatch):
    r = receiver()
    monkeypatch.setenv("ALERT_WEBHOOK_URL", r.url)
    assert alerts.run_failure_alert_sensor(sensor_context(failed_run)) is None
    (request,) = r.requests
    assert request["path"] == "/hooks/batch?token=abc123"
    assert request["headers"]["Content-Type"] == "application/json"
    _, run, _ = failed_run
    assert request["headers"]["Idempotency-Key"] == f"run-failure-{run.run_id}"
    payload = json.loads(request["body"])
    assert payload.pop("sent_at") == pytest.approx(time.time(), abs=30)
    assert payload == {
        "event": "run_failure",
        "run_id": run.run_id,
        "job": "__ephemeral_asset_job__",
        "partition": "2026-12-01",
        "batch": {"api_batch_id": TAGS["batch_pipeline/api_batch_id"], "tenant": "team-a",
                  "batch_name": TAGS["batch_pipeline/batch_name"], "trigger": "batch api"},
        "failure_reason": "STEP_FAILURE",
        "failed_steps": [{"step": "inference_results", "error_class": "ValueError", "error_causes": ["KeyError"]}],
        "error_class": "ValueError",
        "error_causes": ["KeyError"],
        "retry_number": 0,
        "will_retry": False,
    }
    # The rule: nothing of the error's message (which quotes the prompt and the answer) is sent.
    text = request["body"].decode()
    for fragment in ("4111", "medical", "choked", "Patient", "parser", PROMPT, ANSWER):
        assert fragment not in text


def test_a_malformed_url_is_refused_naming_the_variable_not_its_value(failed_run, monkeypatch):
    monkeypatch.setenv("ALERT_WEBHOOK_URL", "hooks.example/secret-token-xyz")
    with pytest.raises(ConfigError) as error:
        alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert "ALERT_WEBHOOK_URL" in str(error.value) and "secret-token-xyz" not in str(error.value)


def test_a_busy_receiver_is_retried_until_it_takes_the_alert(failed_run, receiver, monkeypatch):
    r = receiver(plan=[503, 503])
    monkeypatch.setenv("ALERT_WEBHOOK_URL", r.url)
    assert alerts.run_failure_alert_sensor(sensor_context(failed_run)) is None
    assert len(r.requests) == 3
    assert len({req["body"] for req in r.requests}) == 1  # the same alert each time


def test_a_refusal_is_not_retried(failed_run, receiver, monkeypatch):
    r = receiver(plan=[400])
    monkeypatch.setenv("ALERT_WEBHOOK_URL", r.url)
    result = alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert isinstance(result, dg.SkipReason) and "HTTP 400" in result.skip_message
    assert len(r.requests) == 1


def test_a_receiver_that_is_down_is_dropped_quickly_and_the_next_alerts_try_once(failed_run, receiver, monkeypatch,
                                                                                caplog):
    r = receiver(plan=[500] * 10)
    monkeypatch.setenv("ALERT_WEBHOOK_URL", r.url)
    started = time.monotonic()
    result = alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert isinstance(result, dg.SkipReason) and "not delivered to 127.0.0.1: HTTP 500" in result.skip_message
    assert len(r.requests) == 3 and time.monotonic() - started < 5
    assert "abc123" not in caplog.text and "abc123" not in result.skip_message  # the URL's token stays out
    alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert len(r.requests) == 4  # degraded: one attempt for the next alert


def test_nothing_listening_or_too_slow_ends_in_a_skip_not_an_exception(failed_run, receiver, monkeypatch):
    closed = receiver()
    url = closed.url
    closed.close()
    monkeypatch.setenv("ALERT_WEBHOOK_URL", url)
    result = alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert isinstance(result, dg.SkipReason) and "not delivered" in result.skip_message

    monkeypatch.setattr(alerts, "_degraded_until", 0.0)
    slow = receiver(delay=2.0)
    monkeypatch.setenv("ALERT_WEBHOOK_URL", slow.url)
    started = time.monotonic()
    result = alerts.run_failure_alert_sensor(sensor_context(failed_run))
    assert isinstance(result, dg.SkipReason) and "not delivered" in result.skip_message
    # 3 attempts of a 0.5 s timeout and the backoff between them: bounded, whatever the receiver does.
    assert time.monotonic() - started < 3.5


def test_the_sensor_is_in_the_definitions_and_running_by_default():
    from batch_pipeline.definitions import defs

    sensor = defs().resolve_sensor_def("run_failure_alert_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert "ALERT_WEBHOOK_URL" in sensor.description

"""End to end: a real `dagster dev` (web server, daemon, code server) evaluates `run_failure_alert_sensor`
and POSTs a failed run to ALERT_WEBHOOK_URL, a real HTTP receiver in this process.

Covers: the sensor is running by default (no start through the UI or GraphQL: its first tick comes
by itself), a `batch_job` run submitted over GraphQL as the Batch API submits one (batch id and
tenant tags, a date partition) fails in `validated_requests` (its input does not exist), and the
daemon's tick delivers one alert naming the run, the job, the partition, the batch, the step and the
error's class, and not the error's message (here: the missing file's path).

Does not load a model (the run fails before inference); the payload's every field, retries and
failure modes are in test_alert_sensor.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from batch_pipeline_tests.support.dagster_server import pipeline_env, start_dagster_dev
from batch_pipeline_tests.support import wait_for

SENSOR = "run_failure_alert_sensor"


def test_the_daemon_posts_a_failed_run_to_the_webhook(tmp_path: Path, tiny_model_dir: Path) -> None:
    from dagster_graphql import DagsterGraphQLClient

    from batch_pipeline.defs.jobs import batch_run_config

    received: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            received.append({"path": self.path, "body": self.rfile.read(int(self.headers["Content-Length"]))})
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    env = pipeline_env(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                       ALERT_WEBHOOK_URL=f"http://127.0.0.1:{receiver.server_address[1]}/hook",
                       ALERT_INTERVAL_SECONDS="5")  # the ticks this test waits for, 5 s apart instead of 30
    server = start_dagster_dev(tmp_path / "home", env, tmp_path / "dagster-dev.log")
    try:
        # Running by default: its first tick sets where it starts reading run failures from.
        wait_for("the alert sensor's first tick", lambda: [t for t in server.sensor_ticks(SENSOR)
                                                           if t["status"] != "STARTED"], 120, interval=2,
                 on_timeout=server.log_tail)
        missing = tmp_path / "in" / "missing-file-4711.jsonl"
        config = batch_run_config(input_uri=str(missing), output_uri=str(tmp_path / "out" / "batch_e2e"),
                                  endpoint="/v1/chat/completions", expires_at=None)
        client = DagsterGraphQLClient("127.0.0.1", port_number=server.port)
        run_id = client.submit_job_execution(
            "batch_job", repository_location_name="batch_pipeline", repository_name="__repository__",
            run_config=config, tags={"dagster/partition": "2026-12-01", "batch_pipeline/api_batch_id": "batch_e2e",
                                     "batch_pipeline/tenant": "team-a"})
        run = wait_for("the run failed", lambda: (lambda r: r if r.is_finished else None)(
            server.instance().get_run_by_id(run_id)), 240, interval=2, on_timeout=server.log_tail)
        assert run.status.value == "FAILURE"
        wait_for("the alert", lambda: received or None, 120, interval=1, on_timeout=server.log_tail)
    finally:
        server.stop()
        receiver.shutdown()
        receiver.server_close()
    (alert,) = [r for r in received if json.loads(r["body"])["run_id"] == run_id]
    assert alert["path"] == "/hook"
    payload = json.loads(alert["body"])
    assert {k: payload[k] for k in ("event", "job", "partition", "batch", "failure_reason", "error_class")} == {
        "event": "run_failure", "job": "batch_job", "partition": "2026-12-01",
        "batch": {"api_batch_id": "batch_e2e", "tenant": "team-a"},
        "failure_reason": "STEP_FAILURE", "error_class": "FileNotFoundError"}
    assert [s["step"] for s in payload["failed_steps"]] == ["validated_requests"]
    assert "missing-file-4711" not in alert["body"].decode()  # the error's message stays in Dagster

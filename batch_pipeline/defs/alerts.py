"""`run_failure_alert_sensor`: a failed run of this code location, POSTed as JSON to ALERT_WEBHOOK_URL.

The payload names the run (id, job, partition, the batch: the API's batch id and tenant, or the batch
file's name and shard), how it failed (Dagster's failure reason, each failed step and its error's
class, the classes of its causes) and whether Dagster will retry it; never user text. An error's
message is left out on purpose: the pipeline's own messages quote no line, but an exception raised
inside vLLM, a tokenizer or a parser may quote the prompt or the answer it choked on, and a webhook
usually lands in a chat channel far wider than the run's data. The class, the step and the run id are
enough to page someone; the message and traceback are one click away in the UI.

Delivery never fails the tick for a receiver's sake: each POST has a timeout, is retried on a
connection error, a timeout, 429 and 5xx, and is dropped (logged, the tick's reason says so) when the
attempts are spent; after a drop, the next alerts of the same minute get one attempt each, so a
receiver that is down cannot hold a tick that has many failed runs to report past the sensor's
deadline. The URL may hold a token (chat webhooks do): it is never logged, only its host.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import dagster as dg

from batch_pipeline.base.env import read_checked
from batch_pipeline.config.settings import alert_interval_from_env

log = logging.getLogger("batch_pipeline.alerts")

TIMEOUT_SECONDS = 5.0  # per attempt: connect and answer
ATTEMPTS = 3
BACKOFF_SECONDS = (1.0, 2.0)  # before the 2nd and 3rd attempts
# After a drop, one attempt per alert for this long: 3 x 5 s + 3 s per alert would let a tick with a
# dozen failed runs run past the gRPC deadline of a sensor evaluation (60 s).
DEGRADED_SECONDS = 60.0
RETRY_STATUSES = {408, 425, 429, 500, 502, 503, 504}
# Run tags copied into the alert: ids and names the operator and the pipeline chose, never a line.
BATCH_TAGS = {"api_batch_id": "batch_pipeline/api_batch_id", "tenant": "batch_pipeline/tenant",
              "batch_name": "batch_pipeline/batch_name", "shard": "batch_pipeline/shard",
              "trigger": "batch_pipeline/trigger"}

# Dagster's envelopes around a step's own error (the event log keeps the error as the cause).
DAGSTER_WRAPPERS = {"DagsterExecutionStepExecutionError", "DagsterUserCodeExecutionError"}

_degraded_until = 0.0


def webhook_url_from_env(env: dict[str, str] | None = None) -> str | None:
    """ALERT_WEBHOOK_URL (None: unset, alerts off); ConfigError naming it when it is not an http(s) URL."""
    def is_url(raw: str) -> bool:
        parsed = urllib.parse.urlparse(raw)
        return parsed.scheme in ("http", "https") and bool(parsed.hostname)

    # The value itself is not echoed (secret): it may hold a token.
    return read_checked(env, "ALERT_WEBHOOK_URL", is_url, "an http:// or https:// URL with a host", secret=True) or None


def _error_classes(error: Any) -> tuple[str | None, list[str]]:
    """(the error's class, the classes of its causes, outermost first) of a SerializableErrorInfo."""
    if error is None:
        return None, []
    while error.cls_name in DAGSTER_WRAPPERS and error.cause is not None:
        error = error.cause  # the step's own error, not Dagster's envelope around it
    causes, cause = [], error.cause or error.context
    while cause is not None and len(causes) < 5:
        causes.append(cause.cls_name)
        cause = cause.cause or cause.context
    return error.cls_name, causes


def alert_payload(context: dg.RunFailureSensorContext) -> dict[str, Any]:
    """What the webhook receives for a failed run: ids, names, classes; no message, no line."""
    run = context.dagster_run
    tags = run.tags or {}
    failure = context.failure_event.event_specific_data
    steps = []
    for event in context.get_step_failure_events():
        error_class, causes = _error_classes(getattr(event.event_specific_data, "error", None))
        steps.append({"step": event.step_key, "error_class": error_class, "error_causes": causes})
    run_error_class, run_causes = _error_classes(getattr(failure, "error", None))
    reason = getattr(failure, "failure_reason", None)
    return {
        "event": "run_failure",
        "run_id": run.run_id,
        "job": run.job_name,
        "partition": tags.get("dagster/partition"),
        "batch": {key: tags[tag] for key, tag in BATCH_TAGS.items() if tag in tags},
        "failure_reason": reason.value if reason is not None else None,
        "failed_steps": steps,
        # The step's error when a step failed, else the run's own (a run worker that died, a launch).
        "error_class": steps[0]["error_class"] if steps else run_error_class,
        "error_causes": steps[0]["error_causes"] if steps else run_causes,
        "retry_number": int(tags.get("dagster/retry_number", 0) or 0),
        "will_retry": tags.get("dagster/will_retry") == "true",
        "sent_at": int(time.time()),
    }


def post_alert(url: str, payload: dict[str, Any]) -> str | None:
    """POST `payload` as JSON; None once a receiver took it (2xx), else why it was dropped. Never raises."""
    global _degraded_until
    host = urllib.parse.urlparse(url).hostname
    body = json.dumps(payload).encode()
    attempts, timeout, backoff = ATTEMPTS, TIMEOUT_SECONDS, BACKOFF_SECONDS
    if time.monotonic() < _degraded_until:
        attempts = 1
    problem = "no attempt"
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff[min(attempt - 1, len(backoff) - 1)])
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": "batch-pipeline-alerts",
            # The same run's alert sent twice (a tick retried) carries the same key: receivers may dedupe.
            "Idempotency-Key": f"run-failure-{payload.get('run_id')}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read(1024)
            return None
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code}"
            if e.code not in RETRY_STATUSES:
                break
        except Exception as e:  # noqa: BLE001 - URLError, a timeout, a reset: retried, then dropped
            problem = type(e).__name__
    _degraded_until = time.monotonic() + DEGRADED_SECONDS
    log.warning("alert for run %s to %s not delivered: %s", payload.get("run_id"), host, problem)
    return problem


ALERT_INTERVAL_SECONDS = alert_interval_from_env()


@dg.run_failure_sensor(
    name="run_failure_alert_sensor",
    # Running from the start: ALERT_WEBHOOK_URL is the switch (unset, each tick skips at once).
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=ALERT_INTERVAL_SECONDS,
    description="POSTs each failed run of batch_job or batch_file_job (run, job, partition, batch, failed "
                "step and its error's class; no user text) to ALERT_WEBHOOK_URL; off while it is unset. "
                f"Looks every {ALERT_INTERVAL_SECONDS} s (ALERT_INTERVAL_SECONDS).",
)
def run_failure_alert_sensor(context: dg.RunFailureSensorContext) -> dg.SkipReason | None:
    url = webhook_url_from_env()
    if url is None:
        return dg.SkipReason("ALERT_WEBHOOK_URL is not set: no alert sent")
    payload = alert_payload(context)
    problem = post_alert(url, payload)
    if problem is not None:
        return dg.SkipReason(f"alert for run {payload['run_id']} not delivered to "
                             f"{urllib.parse.urlparse(url).hostname}: {problem}")
    context.log.info(f"alert for run {payload['run_id']} delivered")
    return None

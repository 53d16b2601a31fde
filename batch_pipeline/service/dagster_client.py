"""The one client of the Dagster web server: submit a batch's run, find the run carrying a batch,
terminate it, count the queued runs, and the batch's turn in the run queue.

Each batch is one `batch_job` run, tagged with the batch id and tenant, so the UI shows API batches
beside scheduled and sensor runs. A batch's priority is `metadata["priority"]`; its run's
`dagster/priority` tag is that priority x TURN_SPAN minus the batch's turn among the API's runs of
its priority (`turn`), so Dagster's run queue starts higher priorities first and, within one
priority, serves the tenants in turn; the `gpu` pool orders the steps waiting for it the same way.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import yaml

from batch_pipeline.config.priority import BATCH_PRIORITY_TAG, TURN_SPAN, TURN_TAG, priority_tags
from batch_pipeline.service.batches.protocol import BatchRecord

log = logging.getLogger("batch_pipeline.service")

LOCATION, REPOSITORY, JOB = "batch_pipeline", "__repository__", "batch_job"
# Set on every run submitted for a batch; Dagster copies it into the runs it re-launches from one.
BATCH_ID_TAG = "batch_pipeline/api_batch_id"
TENANT_TAG = "batch_pipeline/tenant"
# Dagster tags a failed run "true" when it will retry it (run_retries), "false" when it will not.
WILL_RETRY_TAG = "dagster/will_retry"
RETRY_NUMBER_TAG, MAX_RETRIES_TAG = "dagster/retry_number", "dagster/max_retries"
# The status current_run reports for a failed run that Dagster retries or may still retry.
RETRYING = "RETRYING"
# A failed run with no retry decision from Dagster is reported over this long after it ended. Dagster
# decides within a second (the tag is written right after the failure) or, where that write was
# missed, on the auto-retry daemon's next pass (5 s); a minute covers a loaded machine.
RETRY_DECISION_SECONDS = 60.0
# A run tagged will_retry=true whose retry run never appeared this long after it failed: the retry
# daemon is not running (the batch is reported failed, and taken up again if the retry comes later).
RETRY_LAUNCH_SECONDS = 900.0
POLICY_SECONDS = 60.0  # how long the instance's run_retries read is kept
TRIGGER_TAG, TRIGGER = "batch_pipeline/trigger", "batch api"


class DagsterClient:
    """The Dagster web server at `url`: its GraphQL API, and dagster_graphql's client for submit and
    terminate. Every call raises what went wrong unless it says otherwise."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client: Any = None
        self._policy_read: tuple[float, RetryPolicy | None] | None = None  # (monotonic time read, policy)

    def _graphql_client(self) -> Any:
        if self._client is None:
            from dagster_graphql import DagsterGraphQLClient

            parsed = urlparse(self.url)
            self._client = DagsterGraphQLClient(parsed.hostname or "127.0.0.1", port_number=parsed.port,
                                                use_https=parsed.scheme == "https", timeout=30)
        return self._client

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `data` of a query to the Dagster web server's GraphQL API; raises what went wrong."""
        request = urllib.request.Request(f"{self.url.rstrip('/')}/graphql",
                                         data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.loads(response.read())
        if body.get("errors") or not body.get("data"):
            raise RuntimeError(f"the query failed: {str(body.get('errors'))[:200]}")
        return body["data"]

    def submit(self, record: BatchRecord) -> str:
        """Queue the batch's `batch_job` run; its id. Sets `record.turn` (kept in the service's record)."""
        from batch_pipeline.defs.jobs import batch_run_config

        # The pipeline itself refuses lines of another url and stops at the deadline, so both hold
        # whether or not this service is up while the run goes.
        config = batch_run_config(input_uri=record.input_uri, output_uri=record.output_uri,
                                  endpoint=record.endpoint, expires_at=record.expires_at,
                                  model_versions=record.model_versions or "")
        tags = {"dagster/partition": record.date, BATCH_ID_TAG: record.id,
                TENANT_TAG: record.tenant, TRIGGER_TAG: TRIGGER, "batch_pipeline/batch_name": record.id}
        record.turn = self.turn(record.tenant, record.priority)
        tags.update(priority_tags(record.priority, record.turn))  # the one scale of every run (defs/jobs.py)
        return self._graphql_client().submit_job_execution(JOB, repository_location_name=LOCATION,
                                                           repository_name=REPOSITORY, run_config=config, tags=tags)

    def terminate_run(self, run_id: str) -> None:
        self._graphql_client().terminate_run(run_id)

    def turn(self, tenant: str, priority: int) -> int:
        """The new batch's turn among the API's runs of its priority (start-time fair queuing, one batch a
        unit): the turn now being served (the highest of the runs in progress, else the lowest queued)
        when the tenant has none queued or running, else one after the tenant's last. Two tenants'
        backlogs so alternate, and a tenant arriving later waits behind no backlog. 0 when nothing of
        the priority is queued or running. Raises what went wrong reading the runs (the web server not
        answering)."""
        data = self.graphql("query Runs($tags: [ExecutionTag!]) { runsOrError(filter: {statuses: "
                            "[QUEUED, NOT_STARTED, STARTING, STARTED], tags: $tags}) { __typename ... on Runs { "
                            "results { status tags { key value } } } ... on PythonError { message } } }",
                            # Only this priority's runs (tags are ANDed): the others never count here.
                            {"tags": [{"key": TRIGGER_TAG, "value": TRIGGER},
                                      {"key": BATCH_PRIORITY_TAG, "value": str(priority)}]})["runsOrError"]
        if "results" not in data:
            raise RuntimeError(f"the runs query failed: {str(data.get('message'))[:200]}")
        queued, running, last = [], [], None
        for run in data["results"]:
            tags = {t["key"]: t["value"] for t in run["tags"]}
            if tags.get(BATCH_PRIORITY_TAG) != str(priority) or not (tags.get(TURN_TAG) or "").isdigit():
                continue
            turn = int(tags[TURN_TAG])
            (queued if run["status"] == "QUEUED" else running).append(turn)
            if tags.get(TENANT_TAG) == tenant:
                last = turn if last is None else max(last, turn)
        serving = max(running) if running else min(queued) if queued else 0
        # Past TURN_SPAN - 1 (a backlog that never empties for a million rounds) turns stop counting: FIFO.
        return min(serving if last is None else max(serving, last + 1), TURN_SPAN - 1)

    def count_queued_runs(self) -> int:
        """Runs waiting in the Dagster instance's queue (every job's, not only this API's; the daemon
        launches them as the `gpu` pool frees), read from the instance's run storage through the web
        server; raises what went wrong (the web server or its database not answering)."""
        runs = self.graphql("{ runsOrError(filter: {statuses: [QUEUED]}) { __typename ... on Runs { count } "
                            "... on PythonError { message } } }")["runsOrError"]
        if "count" not in runs:
            raise RuntimeError(f"the runs query failed: {str(runs.get('message'))[:200]}")
        return int(runs["count"])

    def queued_runs(self) -> int | None:
        """count_queued_runs, or None when it cannot be read."""
        try:
            return self.count_queued_runs()
        except Exception as e:  # noqa: BLE001 - a figure left out, not an error of /metrics
            log.warning("queued runs unknown (%s)", type(e).__name__)
            return None

    def retry_policy(self) -> RetryPolicy | None:
        """The instance's run retries (dagster.yaml `run_retries`) as the web server reports them, read
        once a minute; None when the web server hides its instance config or does not answer (then a
        failed run without Dagster's decision is given the whole grace period: never reported over
        too soon)."""
        now = time.monotonic()
        if self._policy_read is not None and now - self._policy_read[0] < POLICY_SECONDS:
            return self._policy_read[1]
        policy: RetryPolicy | None = None
        try:
            info = self.graphql("{ instance { info } }")["instance"].get("info")
            if info:
                retries = (yaml.safe_load(info) or {}).get("run_retries") or {}
                policy = RetryPolicy(enabled=bool(retries.get("enabled", False)),
                                     max_retries=int(retries.get("max_retries", 0) or 0))
        except Exception as e:  # noqa: BLE001 - unknown: the grace period decides
            log.warning("the instance's run retries unknown (%s)", type(e).__name__)
        self._policy_read = (now, policy)
        return policy

    def current_run(self, record: BatchRecord) -> tuple[str, str | None]:
        """(run id, Dagster run status) of the run now carrying a batch: the newest run with its batch
        id tag. That is the run submitted for it until Dagster re-launches it: an automatic run retry
        (run_retries in the instance's dagster.yaml) or a re-execution from the UI copies the tag into
        the new run, which carries on from the checkpoints. A failed run that Dagster retries or may
        still retry is reported RETRYING, not FAILURE (`retry_outcome`): the batch is not over until
        Dagster has decided not to retry it. Status None: the web server did not answer (the
        submitted run's id is returned then)."""
        fields = "... on Runs { results { runId status endTime updateTime tags { key value } } }"
        query = ("query Batch($tags: [ExecutionTag!], $id: String!) { "
                 f"tagged: runsOrError(filter: {{tags: $tags}}, limit: 1) {{ {fields} }} "
                 f"submitted: runsOrError(filter: {{runIds: [$id]}}) {{ {fields} }} }}")
        try:
            data = self.graphql(query, {"tags": [{"key": BATCH_ID_TAG, "value": record.id}], "id": record.run_id})
        except Exception as e:  # noqa: BLE001 - the web server unreachable: say what is known
            log.warning("batch %s: run status unknown (%s)", record.id, type(e).__name__)
            return record.run_id, None
        runs = [*(data.get("tagged") or {}).get("results", []), *(data.get("submitted") or {}).get("results", [])]
        if not runs:
            return record.run_id, None
        run = runs[0]
        if run["status"] == "FAILURE" and self._outcome(run).retrying:
            return run["runId"], RETRYING
        return run["runId"], run["status"]

    def failure_reason(self, run_id: str) -> str:
        """Why a run that will not be retried failed, in a sentence: its last error messages (the code
        server's 'Run execution process ... terminated by signal 9', a step's error) and Dagster's
        retry decision. Read once per failed batch (the service keeps it in the batch's record)."""
        try:
            data = self.graphql(
                "query Failed($id: ID!) { runOrError(runId: $id) { ... on Run { endTime updateTime tags { key value } } } "
                "logsForRun(runId: $id) { ... on EventConnection { events { __typename "
                "... on MessageEvent { message level } } } } }", {"id": run_id})
        except Exception as e:  # noqa: BLE001 - the run is failed all the same; say what is missing
            return f"its events could not be read ({type(e).__name__}); see the run in the Dagster UI"
        events = (data.get("logsForRun") or {}).get("events") or []
        errors = [e["message"] for e in events if e.get("level") == "ERROR" and e.get("message")]
        said = "; ".join(m.split("\n", 1)[0][:300] for m in errors[-2:]) or "no error message recorded"
        return f"{said}. Not retried: {self._outcome(data.get('runOrError') or {}).why}"

    def _outcome(self, run: dict[str, Any]) -> "RetryOutcome":
        """retry_outcome of a failed run as the web server gives it (tags, endTime, updateTime)."""
        tags = {t["key"]: t["value"] for t in run.get("tags") or []}
        ended = run.get("endTime") or run.get("updateTime")  # the failure's time (its last change, without an end)
        return retry_outcome(tags, ended, self.retry_policy(), time.time())


@dataclass(frozen=True)
class RetryPolicy:
    """The instance's `run_retries`: on or off, and how many retries a run gets."""

    enabled: bool
    max_retries: int


@dataclass(frozen=True)
class RetryOutcome:
    retrying: bool  # a retry has been decided or may still be (the batch is not over)
    why: str


def retry_outcome(tags: dict[str, str], ended_at: float | None, policy: RetryPolicy | None, now: float,
                  grace: float = RETRY_DECISION_SECONDS) -> RetryOutcome:
    """Whether a FAILURE run of a batch is over or will be retried, from what Dagster has made visible.

    Dagster 1.13 fails a run whose worker died in the code server (`_check_for_orphaned_runs`, every
    0.5 s), or in the run-monitoring daemon (launchers that check worker health). Either way the
    instance stores the failure, then tags the run `dagster/will_retry` (`true` or `false`) in a
    second write; the auto-retry daemon (every 5 s) adds the tag where it is missing, launches the
    retry run (which carries the batch's tags) and turns the tag `false` if launching fails. So a
    failed run without the tag is one Dagster has not decided about yet. The rule:
    - `will_retry=true`: retrying; `will_retry=false`: over, Dagster decided not to retry;
    - no tag: over when the instance does not retry runs or the run's retries are spent
      (`dagster/retry_number` >= `dagster/max_retries` or the instance's max_retries), else retrying
      until `grace` seconds after the run ended, then over (no decision came).
    `policy` None (the instance's settings unknown): as if retries were on."""
    will_retry = tags.get(WILL_RETRY_TAG)
    if will_retry == "true":
        if ended_at is not None and now - ended_at >= RETRY_LAUNCH_SECONDS:
            return RetryOutcome(False, f"Dagster tagged it for a retry but launched none in {RETRY_LAUNCH_SECONDS:.0f} s "
                                       "(is the dagster-daemon running?); a retry launched later takes the batch up again")
        return RetryOutcome(True, "Dagster is retrying it")
    if will_retry == "false":
        return RetryOutcome(False, "Dagster decided not to retry it (dagster/will_retry=false)")
    if policy is not None and not policy.enabled:
        return RetryOutcome(False, "the Dagster instance does not retry runs (run_retries off)")
    raw_number = tags.get(RETRY_NUMBER_TAG) or "0"
    number = int(raw_number) if raw_number.isdigit() else 0  # a tag edited into something else: the first try
    max_retries = tags.get(MAX_RETRIES_TAG)
    limit = int(max_retries) if (max_retries or "").isdigit() else (policy.max_retries if policy else None)
    if limit is not None and number >= limit:
        return RetryOutcome(False, f"its retries are spent (attempt {number + 1}, max_retries {limit})")
    if ended_at is None or now - ended_at < grace:
        return RetryOutcome(True, "Dagster has not decided yet whether to retry it")
    return RetryOutcome(False, f"Dagster made no retry decision within {grace:.0f} s of the failure")

"""OpenAI's Files and Batches API over this pipeline (`batch-pipeline serve`): the openai SDK unchanged.

`client.files.create(purpose="batch")` stores the file; `client.batches.create(...)` submits one
`batch_job` run for it to the Dagster instance through its web server (queued; the daemon launches
it, the `gpu` pool gates it; tagged with the batch id and tenant, so the UI shows API batches beside
scheduled and sensor runs); `client.batches.retrieve` reads the run's status and, once written, the
pipeline's own Batch object; `client.files.content(batch.output_file_id)` is the output.jsonl.

Every /v1 path needs `Authorization: Bearer <key>`; keys are BATCH_API_KEYS (`tenant:key` pairs,
comma-separated) or the lines of BATCH_API_KEYS_FILE. A tenant sees only its own files and batches.
Errors are OpenAI's error bodies, so the SDK raises its own typed errors. Logs carry ids and counts,
never file contents; BATCH_API_AUDIT_LOG adds a JSON line per call (`audit.py`).

A batch's priority is `metadata["priority"]` (a whole number, default 0, at most the tenant's cap:
BATCH_API_MAX_PRIORITY, BATCH_API_TENANT_MAX_PRIORITY). Its run's `dagster/priority` tag is that
priority x TURN_SPAN minus the batch's turn among the API's runs of its priority (`turn`), so Dagster's
run queue starts higher priorities first and, within one priority, serves the tenants in turn; the
`gpu` pool orders the steps waiting for it the same way.
"""


import datetime as dt
import hmac
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from batch_pipeline.contract import contract
from batch_pipeline.io import storage
from batch_pipeline.io.checkpoints import LineSet, iter_answers
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.config.settings import ConfigError, storage_settings_from_env
from batch_pipeline.service.audit import AuditLog, AuditMiddleware, audit_log_from_env
from batch_pipeline.service.store import Store, new_id

log = logging.getLogger("batch_pipeline.service")

LOCATION, REPOSITORY, JOB = "batch_pipeline", "__repository__", "batch_job"
# Set on every run submitted for a batch; Dagster copies it into the runs it re-launches from one.
BATCH_ID_TAG = "batch_pipeline/api_batch_id"
TENANT_TAG = "batch_pipeline/tenant"
# How long a cancel waits for a STARTING run (which Dagster cannot terminate) to start; after that the
# next read of the batch terminates it.
TERMINATE_WAIT = 15.0
# Dagster tags a failed run it is going to retry (run_retries) with this, "true".
WILL_RETRY_TAG = "dagster/will_retry"
# Dagster's run priority: its run queue (QueuedRunCoordinator) dequeues higher values first (first come
# first served among equals), and concurrency pools hand a free slot to the waiting step of the
# highest-priority run. Set to priority x TURN_SPAN - turn (see `turn`).
PRIORITY_TAG = "dagster/priority"
# The batch's own priority and its turn, beside the composite dagster/priority, for people and `turn`.
BATCH_PRIORITY_TAG, TURN_TAG = "batch_pipeline/priority", "batch_pipeline/turn"
TRIGGER_TAG, TRIGGER = "batch_pipeline/trigger", "batch api"
PRIORITY_KEY = "priority"
# A priority is a whole number within +-PRIORITY_BOUND; each tenant's highest is capped by the operator
# (BATCH_API_MAX_PRIORITY, default 0). Turns take TURN_SPAN values under one priority, so the composite
# stays within +-1e9: Dagster stores it in a 32-bit integer column (the pools' pending steps).
PRIORITY_BOUND = 1000
TURN_SPAN = 1_000_000
# OpenAI's only completion window; an operator may allow others (BATCH_API_COMPLETION_WINDOWS).
COMPLETION_WINDOWS = {"24h": 24 * 3600}
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's limits for a batch input file (BATCH_API_MAX_FILE_BYTES / _REQUESTS change them).
MAX_FILE_BYTES = 200 * 2**20
MAX_FILE_REQUESTS = 50_000
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# OpenAI's range for files' `expires_after` and batches' `output_expires_after` (1 hour to 30 days).
MIN_EXPIRY_SECONDS, MAX_EXPIRY_SECONDS = 3600, 30 * 24 * 3600
TERMINAL_STATUSES = ("completed", "failed", "cancelled", "expired")
BATCH_ENDPOINTS = (contract.CHAT_URL, contract.COMPLETIONS_URL, contract.EMBEDDINGS_URL, contract.RESPONSES_URL)
# Dagster run status -> Batch status, while the pipeline has not written its Batch object.
RUN_STATUS = {"QUEUED": "validating", "NOT_STARTED": "validating", "STARTING": "validating", "STARTED": "in_progress",
              "CANCELING": "cancelling", "CANCELED": "cancelled", "FAILURE": "failed", "SUCCESS": "finalizing"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def load_keys(env: dict[str, str] | None = None) -> dict[str, str]:
    """{key: tenant} from BATCH_API_KEYS and BATCH_API_KEYS_FILE; ConfigError naming the variable."""
    env = dict(os.environ if env is None else env)
    entries: list[tuple[str, str]] = []
    for item in env.get("BATCH_API_KEYS", "").split(","):
        if item.strip():
            entries.append(("BATCH_API_KEYS", item.strip()))
    path = env.get("BATCH_API_KEYS_FILE", "").strip()
    if path:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise ConfigError(f"BATCH_API_KEYS_FILE={path} cannot be read: {e}") from None
        entries += [("BATCH_API_KEYS_FILE", line.strip()) for line in lines if line.strip() and not line.startswith("#")]
    keys: dict[str, str] = {}
    for source, item in entries:
        tenant, sep, key = item.partition(":")
        if not sep or not tenant.strip() or len(key.strip()) < 8:
            raise ConfigError(f"{source}: an entry is not tenant:key with a key of 8 characters or more")
        keys[key.strip()] = tenant.strip()
    if not keys:
        raise ConfigError("no API keys: set BATCH_API_KEYS (tenant:key pairs, comma-separated) or BATCH_API_KEYS_FILE")
    return keys


def completion_windows(env: dict[str, str] | None = None) -> dict[str, int]:
    """{window: seconds} a batch may ask for: OpenAI's "24h", plus the durations an operator allows
    in BATCH_API_COMPLETION_WINDOWS (comma-separated, e.g. "1h,48h,7d"; an extension of OpenAI's API)."""
    env = dict(os.environ if env is None else env)
    windows = dict(COMPLETION_WINDOWS)
    for name in (w.strip() for w in env.get("BATCH_API_COMPLETION_WINDOWS", "").split(",")):
        if not name:
            continue
        match = re.fullmatch(r"([1-9][0-9]*)([smhd])", name)
        if match is None:
            raise ConfigError(f"BATCH_API_COMPLETION_WINDOWS: {name!r} is not a duration such as 90s, 30m, 48h or 7d")
        windows[name] = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return windows


def load_limits(tenants: set[str], env: dict[str, str] | None = None) -> tuple[int | None, dict[str, int | None]]:
    """Batches in flight per tenant: (BATCH_API_MAX_IN_FLIGHT, {tenant: limit} from
    BATCH_API_TENANT_LIMITS, `none` for no limit); ConfigError naming the variable."""
    env = dict(os.environ if env is None else env)
    default = _positive(env.get("BATCH_API_MAX_IN_FLIGHT", ""), "BATCH_API_MAX_IN_FLIGHT")
    overrides: dict[str, int | None] = {}
    for item in env.get("BATCH_API_TENANT_LIMITS", "").split(","):
        if not item.strip():
            continue
        tenant, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or not tenant:
            raise ConfigError(f"BATCH_API_TENANT_LIMITS: {item.strip()!r} is not tenant:limit (e.g. team-a:2,team-b:none)")
        if tenant not in tenants:
            raise ConfigError(f"BATCH_API_TENANT_LIMITS: tenant {tenant!r} has no API key (BATCH_API_KEYS)")
        overrides[tenant] = None if value.lower() == "none" else _positive(value, f"BATCH_API_TENANT_LIMITS ({tenant})")
    return default, overrides


def load_priority_caps(tenants: set[str], env: dict[str, str] | None = None) -> tuple[int, dict[str, int]]:
    """The highest `metadata["priority"]` a tenant may give: (BATCH_API_MAX_PRIORITY, default 0, for
    every tenant; {tenant: cap} from BATCH_API_TENANT_MAX_PRIORITY, `team-a:10,team-b:0`);
    ConfigError naming the variable."""
    env = dict(os.environ if env is None else env)
    default = _cap(env.get("BATCH_API_MAX_PRIORITY", ""), "BATCH_API_MAX_PRIORITY")
    overrides: dict[str, int] = {}
    for item in env.get("BATCH_API_TENANT_MAX_PRIORITY", "").split(","):
        if not item.strip():
            continue
        tenant, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or not tenant:
            raise ConfigError(f"BATCH_API_TENANT_MAX_PRIORITY: {item.strip()!r} is not tenant:cap (e.g. team-a:10,team-b:0)")
        if tenant not in tenants:
            raise ConfigError(f"BATCH_API_TENANT_MAX_PRIORITY: tenant {tenant!r} has no API key (BATCH_API_KEYS)")
        overrides[tenant] = _cap(value, f"BATCH_API_TENANT_MAX_PRIORITY ({tenant})")
    return default, overrides


def _cap(value: str, name: str) -> int:
    if not value.strip():
        return 0
    if not re.fullmatch(r"[0-9]+", value.strip()) or int(value) > PRIORITY_BOUND:
        raise ConfigError(f"{name}={value.strip()!r}: a whole number from 0 to {PRIORITY_BOUND}")
    return int(value)


def min_expiry_seconds(env: dict[str, str] | None = None) -> int:
    """BATCH_API_MIN_EXPIRY_SECONDS: the shortest expiry accepted (OpenAI's 3600 unless lowered)."""
    env = dict(os.environ if env is None else env)
    value = _positive(env.get("BATCH_API_MIN_EXPIRY_SECONDS", ""), "BATCH_API_MIN_EXPIRY_SECONDS")
    if value is not None and value > MAX_EXPIRY_SECONDS:
        raise ConfigError(f"BATCH_API_MIN_EXPIRY_SECONDS={value}: above the longest expiry, {MAX_EXPIRY_SECONDS}")
    return MIN_EXPIRY_SECONDS if value is None else value


def _positive(value: str, name: str) -> int | None:
    if not value.strip():
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{name}={value.strip()!r}: a whole number of 1 or more")
    return number


@dataclass
class Service:
    store: Store
    keys: dict[str, str]
    dagster_url: str
    max_file_bytes: int = MAX_FILE_BYTES
    max_file_requests: int = MAX_FILE_REQUESTS
    windows: dict[str, int] = field(default_factory=lambda: dict(COMPLETION_WINDOWS))
    max_in_flight: int | None = None  # batches of one tenant not finished; None: no limit
    tenant_limits: dict[str, int | None] = field(default_factory=dict)  # per tenant, over max_in_flight
    min_expiry: int = MIN_EXPIRY_SECONDS
    max_priority: int = 0  # the highest metadata["priority"] of a tenant without its own cap
    tenant_max_priority: dict[str, int] = field(default_factory=dict)  # per tenant, over max_priority
    audit: AuditLog | None = None  # BATCH_API_AUDIT_LOG: a JSON line per call
    _client: Any = field(default=None, repr=False)

    # -- identity ----------------------------------------------------------------------------

    def tenant(self, authorization: str | None) -> str:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
        found = None
        for known, tenant in self.keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                found = tenant
        if found is None:
            raise ApiError(401, "incorrect API key", code="invalid_api_key")
        return found

    def tenant_or_none(self, authorization: str | None) -> str | None:
        """The key's tenant, or None for a missing or wrong key (the audit log's)."""
        try:
            return self.tenant(authorization)
        except ApiError:
            return None

    # -- Dagster -----------------------------------------------------------------------------

    def dagster(self) -> Any:
        if self._client is None:
            from dagster_graphql import DagsterGraphQLClient

            url = urlparse(self.dagster_url)
            self._client = DagsterGraphQLClient(url.hostname or "127.0.0.1", port_number=url.port,
                                                use_https=url.scheme == "https", timeout=30)
        return self._client

    def submit(self, record: dict[str, Any]) -> str:
        from batch_pipeline.defs.jobs import batch_run_config

        # The pipeline itself refuses lines of another url and stops at the deadline, so both hold
        # whether or not this service is up while the run goes.
        config = batch_run_config(input_uri=record["input_uri"], output_uri=record["output_uri"],
                                  endpoint=record["endpoint"], expires_at=record["expires_at"])
        tags = {"dagster/partition": record["date"], BATCH_ID_TAG: record["id"],
                TENANT_TAG: record["tenant"], TRIGGER_TAG: TRIGGER, "batch_pipeline/batch_name": record["id"]}
        priority = record.get("priority", 0)
        record["turn"] = self.turn(record["tenant"], priority)  # kept in the service's record too
        tags.update({PRIORITY_TAG: str(priority * TURN_SPAN - record["turn"]), BATCH_PRIORITY_TAG: str(priority),
                     TURN_TAG: str(record["turn"])})
        return self.dagster().submit_job_execution(JOB, repository_location_name=LOCATION, repository_name=REPOSITORY,
                                                    run_config=config, tags=tags)

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
                            {"tags": [{"key": TRIGGER_TAG, "value": TRIGGER}]})["runsOrError"]
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

    def graphql(self, query: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        """The `data` of a query to the Dagster web server's GraphQL API; raises what went wrong."""
        import urllib.request

        request = urllib.request.Request(f"{self.dagster_url.rstrip('/')}/graphql",
                                         data=json.dumps({"query": query, "variables": variables or {}}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.loads(response.read())
        if body.get("errors") or not body.get("data"):
            raise RuntimeError(f"the query failed: {str(body.get('errors'))[:200]}")
        return body["data"]

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

    def current_run(self, record: dict[str, Any]) -> tuple[str, str | None]:
        """(run id, Dagster run status) of the run now carrying a batch: the newest run with its batch
        id tag. That is the run submitted for it until Dagster re-launches it: an automatic run retry
        (run_retries in the instance's dagster.yaml) or a re-execution from the UI copies the tag into
        the new run, which carries on from the checkpoints. A failed run Dagster is about to retry
        (tagged dagster/will_retry=true) is reported QUEUED: the batch is not over. Status None: the
        web server did not answer (the submitted run's id is returned then)."""
        fields = "... on Runs { results { runId status tags { key value } } }"
        query = ("query Batch($tags: [ExecutionTag!], $id: String!) { "
                 f"tagged: runsOrError(filter: {{tags: $tags}}, limit: 1) {{ {fields} }} "
                 f"submitted: runsOrError(filter: {{runIds: [$id]}}) {{ {fields} }} }}")
        try:
            data = self.graphql(query, {"tags": [{"key": BATCH_ID_TAG, "value": record["id"]}], "id": record["run_id"]})
        except Exception as e:  # noqa: BLE001 - the web server unreachable: say what is known
            log.warning("batch %s: run status unknown (%s)", record["id"], type(e).__name__)
            return record["run_id"], None
        runs = [*(data.get("tagged") or {}).get("results", []), *(data.get("submitted") or {}).get("results", [])]
        if not runs:
            return record["run_id"], None
        run = runs[0]
        tags = {t["key"]: t["value"] for t in run.get("tags") or []}
        if run["status"] == "FAILURE" and tags.get(WILL_RETRY_TAG) == "true":
            return run["runId"], "QUEUED"
        return run["runId"], run["status"]

    # -- files -------------------------------------------------------------------------------

    def create_file(self, tenant: str, filename: str, purpose: str, data: bytes,
                    expires_after: dict[str, Any] | None = None) -> dict[str, Any]:
        seconds = self.expiry_seconds(expires_after, "expires_after")
        if purpose != "batch":
            raise ApiError(400, f"purpose {purpose!r} is not served here: only 'batch'", param="purpose")
        if len(data) > self.max_file_bytes:
            raise ApiError(400, f"the file is {len(data)} bytes, over the limit of {self.max_file_bytes}", param="file")
        lines = [line for line in data.splitlines() if line.strip()]
        if len(lines) > self.max_file_requests:
            raise ApiError(400, f"the file has {len(lines)} requests, over the limit of {self.max_file_requests}",
                           param="file")
        if not lines or not any(_json_object(line) for line in lines[:100]):
            raise ApiError(400, "the file is not JSONL: none of its first lines is a JSON object (one request per line)",
                           param="file")
        record = self.store.add_file(tenant, filename, purpose, data, expires_after=seconds)
        log.info("file %s: %d bytes, %d lines, tenant %s", record["id"], len(data), len(lines), tenant)
        return record

    def get_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        record = self.store.file(tenant, file_id)
        if record is None:
            raise ApiError(404, f"no file {file_id!r}", param="file_id", code="not_found")
        return record

    def expiry_seconds(self, policy: Any, param: str) -> int | None:
        """Seconds of an `{"anchor": "created_at", "seconds": N}` expiry policy (None: none given)."""
        if policy is None:
            return None
        if not isinstance(policy, dict):
            raise ApiError(400, f"{param}: an object {{anchor, seconds}}", param=param)
        if policy.get("anchor") != "created_at":
            raise ApiError(400, f"{param}.anchor {policy.get('anchor')!r}: only 'created_at'", param=f"{param}.anchor")
        seconds = policy.get("seconds")
        try:
            seconds = int(seconds) if not isinstance(seconds, (bool, float)) else None
        except (TypeError, ValueError):
            seconds = None
        if seconds is None or not self.min_expiry <= seconds <= MAX_EXPIRY_SECONDS:
            raise ApiError(400, f"{param}.seconds {policy.get('seconds')!r}: a whole number of seconds from "
                                f"{self.min_expiry} to {MAX_EXPIRY_SECONDS}", param=f"{param}.seconds")
        return seconds

    # -- batches -----------------------------------------------------------------------------

    def batch_options(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        """What create_batch records beside OpenAI's required fields, once the tenant may start one more
        batch: the results' expiry (`output_expires_after`, seconds after they are written)."""
        options = {"output_expires_after": self.expiry_seconds(body.get("output_expires_after"), "output_expires_after")}
        self.check_in_flight(tenant)
        return options

    def check_in_flight(self, tenant: str) -> None:
        """429 when the tenant already has as many unfinished batches as its limit allows."""
        limit = self.tenant_limits.get(tenant, self.max_in_flight)
        if limit is None:
            return
        in_flight = 0
        for record in self.store.batches(tenant):
            if self.batch_object(record)["status"] not in TERMINAL_STATUSES:
                in_flight += 1
                if in_flight >= limit:
                    log.info("batch refused: tenant %s has %d batches in flight (limit %d)", tenant, in_flight, limit)
                    raise ApiError(429, f"too many batches in flight: this tenant may have {limit} unfinished "
                                        f"at once; retry when one completes, fails, expires or is cancelled",
                                   type_="requests", code="rate_limit_exceeded")

    def priority(self, tenant: str, metadata: dict[str, Any]) -> int:
        """The batch's priority from metadata["priority"]: a whole number (an integer, or a string of
        digits as the openai SDK sends metadata), default 0, at most the tenant's cap; 400 otherwise."""
        value = metadata.get(PRIORITY_KEY, 0)
        if isinstance(value, bool) or not (isinstance(value, int) or (
                isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,7}", value.strip()))):
            raise ApiError(400, f"metadata.priority {value!r} is not a whole number (e.g. \"5\"; higher starts "
                                "first; the default is 0)", param="metadata.priority")
        priority = int(value)
        cap = self.tenant_max_priority.get(tenant, self.max_priority)
        if priority > cap:
            raise ApiError(400, f"metadata.priority {priority} is above this tenant's highest priority, {cap}",
                           param="metadata.priority")
        if priority < -PRIORITY_BOUND:
            raise ApiError(400, f"metadata.priority {priority} is below the lowest priority, {-PRIORITY_BOUND}",
                           param="metadata.priority")
        return priority

    def create_batch(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        options = self.batch_options(tenant, body)  # limits and retention (429, 400): before anything is recorded
        source = self.get_file(tenant, str(body.get("input_file_id") or ""))
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise ApiError(400, f"endpoint {endpoint!r} is not one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
        window = body.get("completion_window", "24h")
        if window not in self.windows:
            raise ApiError(400, f"completion_window {window!r} is not allowed here: {', '.join(map(repr, self.windows))} "
                                "(an operator may allow more with BATCH_API_COMPLETION_WINDOWS)", param="completion_window")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or any(
                not isinstance(k, str) or len(k) > MAX_METADATA_KEY or (not isinstance(v, str) and k != PRIORITY_KEY)
                or len(str(v)) > MAX_METADATA_VALUE for k, v in metadata.items()):
            raise ApiError(400, f"metadata: at most {MAX_METADATA_PAIRS} string pairs, keys up to {MAX_METADATA_KEY} "
                                f"and values up to {MAX_METADATA_VALUE} characters", param="metadata")
        priority = self.priority(tenant, metadata)
        if PRIORITY_KEY in metadata:  # kept as the SDK's metadata values are: a string ("7", not 7 or "07")
            metadata = {**metadata, PRIORITY_KEY: str(priority)}
        now = time.time()
        date = dt.datetime.fromtimestamp(now, dt.timezone.utc).date().isoformat()
        batch_id = new_id("batch_")
        record = {"id": batch_id, "tenant": tenant, "input_file_id": source["id"], "input_uri": source["uri"],
                  "endpoint": endpoint, "completion_window": window, "metadata": metadata, "priority": priority,
                  "created_at": int(now),
                  "expires_at": int(now) + self.windows[window],
                  "date": date, "output_uri": storage.join(self.store.output_root, date, batch_id), "run_id": None}
        record.update(options)
        self.store.save_batch(record)  # first: a crash before the run is submitted leaves a failed batch, not none
        try:
            record["run_id"] = self.submit(record)
        except Exception as e:  # noqa: BLE001
            record["submit_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            self.store.save_batch(record)
            log.error("batch %s: the run could not be submitted (%s)", batch_id, type(e).__name__)
            raise ApiError(503, "the batch could not be queued: the Dagster instance is not reachable; try again",
                           type_="server_error") from None
        self.store.save_batch(record)
        log.info("batch %s: run %s for file %s, tenant %s", batch_id, record["run_id"], source["id"], tenant)
        return self.batch_object(record)

    def get_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        record = self.store.batch(tenant, batch_id)
        if record is None:
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="not_found")
        return record

    def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        record = self.get_batch(tenant, batch_id)
        current = self.batch_object(record)
        if current["status"] in TERMINAL_STATUSES:
            raise ApiError(400, f"batch {batch_id} is {current['status']}: it cannot be cancelled")
        record["cancelling_at"] = int(time.time())
        self.store.save_batch(record)
        if record.get("run_id"):  # the run keeps its answers, reports the rest cancelled
            self.terminate(record)
        log.info("batch %s: cancel requested", batch_id)
        return self.batch_object(record)

    def terminate(self, record: dict[str, Any], wait: float = TERMINATE_WAIT) -> None:
        """Ask Dagster to terminate the batch's run. Dagster refuses while the run is STARTING (its worker
        coming up): this waits up to `wait` seconds for it to start, else records `terminate_pending`,
        and the next read of the batch (retrieve, list) that finds the run started terminates it."""
        deadline = time.monotonic() + wait
        while True:
            run_id, status = self.current_run(record)
            if status in ("SUCCESS", "FAILURE", "CANCELED", "CANCELING"):
                break
            if status != "STARTING":
                try:
                    self.dagster().terminate_run(run_id)
                    break
                except Exception as e:  # noqa: BLE001 - STARTING by now: wait as below; anything else is an error
                    if "STARTING" not in str(e):
                        raise
            if time.monotonic() >= deadline:
                record["terminate_pending"] = True
                self.store.save_batch(record)
                log.info("batch %s: run %s still starting; terminated once started", record["id"], run_id)
                return
            time.sleep(1)
        if record.pop("terminate_pending", None):
            self.store.save_batch(record)

    def batch_object(self, record: dict[str, Any]) -> dict[str, Any]:
        """The OpenAI Batch object: the pipeline's batch.json once written, else the run's status."""
        pipeline = _read_json(storage.join(record["output_uri"], "batch.json"))
        base: dict[str, Any] = {
            "id": record["id"], "object": "batch", "endpoint": record["endpoint"], "input_file_id": record["input_file_id"],
            "completion_window": record["completion_window"], "created_at": record["created_at"],
            "expires_at": record.get("expires_at", record["created_at"] + COMPLETION_WINDOWS["24h"]),
            "metadata": record["metadata"], "errors": None,
            "output_file_id": None, "error_file_id": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
        }
        if pipeline is not None:
            status = pipeline["status"]
            base.update({k: pipeline.get(k) for k in ("model", "usage", "errors", "in_progress_at", "finalizing_at",
                                                      "completed_at", "failed_at", "cancelling_at", "cancelled_at",
                                                      "expired_at")})
            base.update(status=status, request_counts=pipeline["request_counts"],
                        output_file_id=f"file-{record['id']}-output", error_file_id=f"file-{record['id']}-errors")
            base["cancelling_at"] = base.get("cancelling_at") or record.get("cancelling_at")
            return base
        if record.get("submit_error"):
            return {**base, "status": "failed", "failed_at": record["created_at"],
                    "errors": {"object": "list", "data": [{"code": "not_queued", "message": "the run could not be submitted"}]}}
        run_id, run_status = self.current_run(record)
        if record.get("terminate_pending") and run_status not in (None, "STARTING"):
            self.terminate(record, wait=0)  # a cancel that came while the run was starting
            run_id, run_status = self.current_run(record)
        status = RUN_STATUS.get(run_status or "", "validating")
        counts = live_counts(record)
        if counts is not None:  # validated: the lines so far (answers as their checkpoints are written)
            base["request_counts"] = counts
            if status == "validating":
                status = "in_progress"
        if record.get("cancelling_at") and status not in ("cancelled", "failed"):
            status = "cancelling"
        base["status"] = status
        if status == "cancelling":
            base["cancelling_at"] = record.get("cancelling_at")
        if status == "failed":
            base["failed_at"] = int(time.time())
            base["errors"] = {"object": "list", "data": [{"code": "run_failed", "message":
                              f"Dagster run {run_id} failed before writing results; see it in the UI"}]}
        return base


def live_counts(record: dict[str, Any]) -> dict[str, int] | None:
    """request_counts of a batch still running: its lines, the bad ones, the answers checkpointed."""
    loc = BatchLocation(record["id"], record["input_uri"], record["output_uri"], record["date"])
    validation = _read_json(loc.work("validation.json"))
    if validation is None:
        return None
    counts = {"total": validation["lines"], "completed": 0, "failed": validation["lines"] - validation["valid"]}
    inference = _read_json(loc.work("inference.json"))
    if inference and inference.get("checkpoint_key"):
        seen = LineSet()
        for answer in iter_answers(loc, inference["checkpoint_key"]):
            if seen.add(answer["line"]):  # a line two overlapping attempts both wrote counts once
                counts["completed" if answer["kind"] == "output" else "failed"] += 1
    return counts


def readiness(service: "Service") -> list[str]:
    """What keeps the service from serving: the storage, and the Dagster instance (its web server and
    run storage: a query of its runs), each checked."""
    problems = []
    try:
        storage.list_objects(storage.join(service.store.output_root, "_batch_api", "batches") + "/")
    except Exception as e:  # noqa: BLE001
        problems.append(f"storage {service.store.output_root}: {type(e).__name__}: {str(e)[:200]}")
    try:
        service.count_queued_runs()
    except Exception as e:  # noqa: BLE001
        problems.append(f"Dagster web server {service.dagster_url}: {type(e).__name__}: {str(e)[:200]}")
    return problems


def prometheus(service: "Service") -> str:
    """The service's figures in Prometheus' text format: batches by status, files, lines and tokens
    of finished batches, over every tenant (no ids, no text), and the runs queued in Dagster."""
    by_status: dict[str, int] = {}
    lines = {"completed": 0, "failed": 0}
    tokens = {"input": 0, "output": 0}
    for record in service.store.all_batches():
        batch = service.batch_object(record)
        by_status[batch["status"]] = by_status.get(batch["status"], 0) + 1
        if batch["status"] in ("completed", "cancelled", "expired", "failed") and batch.get("usage"):
            lines["completed"] += batch["request_counts"]["completed"]
            lines["failed"] += batch["request_counts"]["failed"]
            tokens["input"] += batch["usage"].get("input_tokens", 0)
            tokens["output"] += batch["usage"].get("output_tokens", 0)
    out = ["# HELP batch_pipeline_api_batches Batches of the Batch API by status.",
           "# TYPE batch_pipeline_api_batches gauge"]
    for status in sorted(set(by_status) | {"validating", "in_progress", "completed", "failed", "cancelled"}):
        out.append(f'batch_pipeline_api_batches{{status="{status}"}} {by_status.get(status, 0)}')
    out += ["# HELP batch_pipeline_api_lines Lines of finished batches, answered or failed.",
            "# TYPE batch_pipeline_api_lines gauge"]
    out += [f'batch_pipeline_api_lines{{result="{k}"}} {v}' for k, v in lines.items()]
    out += ["# HELP batch_pipeline_api_tokens Tokens of finished batches.", "# TYPE batch_pipeline_api_tokens gauge"]
    out += [f'batch_pipeline_api_tokens{{kind="{k}"}} {v}' for k, v in tokens.items()]
    out += ["# HELP batch_pipeline_api_files Uploaded files kept.", "# TYPE batch_pipeline_api_files gauge",
            f"batch_pipeline_api_files {service.store.count_files()}"]
    queued = service.queued_runs()
    if queued is not None:  # left out (not 0) when the Dagster web server does not answer
        out += ["# HELP batch_pipeline_api_queued_runs Runs waiting in the Dagster instance's queue, of every job.",
                "# TYPE batch_pipeline_api_queued_runs gauge", f"batch_pipeline_api_queued_runs {queued}"]
    return "\n".join(out) + "\n"


def _json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _read_json(uri: str) -> dict[str, Any] | None:
    try:
        return storage.read_json(uri)
    except FileNotFoundError:
        return None


def _public(record: dict[str, Any]) -> dict[str, Any]:
    """A file record as OpenAI's FileObject (without where it is stored or whose it is)."""
    return {k: v for k, v in record.items() if k not in ("tenant", "uri", "deleted", "expired")}


def create_app(service: Service) -> Any:
    from fastapi import FastAPI, File, Form, Header, Request, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="batch_pipeline Batch API", docs_url=None, redoc_url=None)
    if service.audit is not None:  # a JSON line per call (BATCH_API_AUDIT_LOG), X-Request-Id on every answer
        app.add_middleware(AuditMiddleware, log=service.audit, tenant_of=service.tenant_or_none)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "form"))
        return JSONResponse(ApiError(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None).body(),
                            status_code=400)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    def ready() -> JSONResponse:
        problems = readiness(service)
        return JSONResponse({"status": "not ready", "problems": problems} if problems else {"status": "ready"},
                            status_code=503 if problems else 200)

    @app.get("/metrics")
    def metrics(authorization: str | None = Header(default=None)) -> Response:
        service.tenant(authorization)  # any tenant's key (Prometheus: bearer_token)
        return Response(prometheus(service), media_type="text/plain; version=0.0.4")

    @app.post("/v1/files")
    async def create_file(file: UploadFile = File(...), purpose: str = Form(...),
                          anchor: str | None = Form(default=None, alias="expires_after[anchor]"),
                          seconds: str | None = Form(default=None, alias="expires_after[seconds]"),
                          authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        expires_after = None if anchor is None and seconds is None else {"anchor": anchor, "seconds": seconds}
        data = await file.read(service.max_file_bytes + 1)
        return _public(service.create_file(tenant, file.filename or "batch.jsonl", purpose, data, expires_after))

    @app.get("/v1/files")
    def list_files(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        data = [_public(r) for r in service.store.files(tenant)]
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return _public(service.get_file(service.tenant(authorization), file_id))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, authorization: str | None = Header(default=None)) -> Response:
        record = service.get_file(service.tenant(authorization), file_id)
        return Response(storage.read_bytes(record["uri"]), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        record = service.get_file(service.tenant(authorization), file_id)
        if record["purpose"] == "batch_output":
            raise ApiError(400, "a batch's output and error files stay as long as the batch", param="file_id")
        service.store.delete_file(record)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body is not a JSON object")
        return service.create_batch(tenant, body)

    @app.get("/v1/batches")
    def list_batches(after: str | None = None, limit: int = 20,
                     authorization: str | None = Header(default=None)) -> dict[str, Any]:
        tenant = service.tenant(authorization)
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit: from 1 to 100", param="limit")
        records = service.store.batches(tenant)
        if after:
            ids = [r["id"] for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        page = records[:limit]
        data = [service.batch_object(r) for r in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.batch_object(service.get_batch(service.tenant(authorization), batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        return service.cancel_batch(service.tenant(authorization), batch_id)

    return app


def service_from_env() -> Service:
    env = os.environ
    keys = load_keys()
    max_in_flight, tenant_limits = load_limits(set(keys.values()))
    max_priority, tenant_max_priority = load_priority_caps(set(keys.values()))
    return Service(
        store=Store(storage_settings_from_env().output_path),
        keys=keys,
        dagster_url=env.get("DAGSTER_WEBSERVER_URL", "http://127.0.0.1:3000"),
        windows=completion_windows(),
        max_in_flight=max_in_flight,
        tenant_limits=tenant_limits,
        min_expiry=min_expiry_seconds(),
        max_priority=max_priority,
        tenant_max_priority=tenant_max_priority,
        max_file_bytes=_positive(env.get("BATCH_API_MAX_FILE_BYTES", ""), "BATCH_API_MAX_FILE_BYTES") or MAX_FILE_BYTES,
        max_file_requests=(_positive(env.get("BATCH_API_MAX_FILE_REQUESTS", ""), "BATCH_API_MAX_FILE_REQUESTS")
                           or MAX_FILE_REQUESTS),
        audit=audit_log_from_env(),  # last: a bad setting above refuses the start before the file is opened
    )


__all__ = ["Service", "create_app", "service_from_env", "load_keys", "load_limits", "load_priority_caps",
           "min_expiry_seconds"]

"""What each Batches call does over the store and the Dagster web server (no HTTP here): create
(limits in flight, priority, model versions), retrieve (the Batch object), cancel (and a cancel left
pending while the run starts)."""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from typing import Any

from batch_pipeline.config.priority import PRIORITY_BOUND
from batch_pipeline.config.settings import ConfigError, engine_settings_from_env
from batch_pipeline import contract
from batch_pipeline.io import storage
from batch_pipeline.io.model_aliases import resolved_pins
from batch_pipeline.service import status
from batch_pipeline.service.batches.protocol import BatchObject, BatchRecord, PendingTermination
from batch_pipeline.service.dagster_client import RETRYING, DagsterClient
from batch_pipeline.service.errors import ApiError
from batch_pipeline.service.files.serving import FileServing
from batch_pipeline.service.api_settings import MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, PRIORITY_KEY
from batch_pipeline.service.status import TERMINAL_STATUSES
from batch_pipeline.service.store import new_id

log = logging.getLogger("batch_pipeline.service")

# How long a cancel waits for a STARTING run (which Dagster cannot terminate) to start; after that
# the service's sweep (every SWEEP_SECONDS, `batch-pipeline serve`) or the next read of the batch
# terminates it once it has started.
TERMINATE_WAIT = 15.0
SWEEP_SECONDS = 5.0
PENDING_FOLDER = "terminate_pending"  # under _batch_api/: a marker per batch whose run awaits its terminate
BATCH_ENDPOINTS = (contract.CHAT_URL, contract.COMPLETIONS_URL, contract.EMBEDDINGS_URL, contract.RESPONSES_URL)


class BatchServing(FileServing):
    """The Batches calls of `operations.Service` (a batch's input is one of the tenant's files), which
    holds the windows, the limits and the Dagster client named here."""

    windows: dict[str, int]
    max_in_flight: int | None
    tenant_limits: dict[str, int | None]
    max_priority: int
    tenant_max_priority: dict[str, int]
    dagster: DagsterClient

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
        for record in self.store.open_batches(tenant):  # not every batch it ever made: flat in its history
            if self.batch_object(record).status not in TERMINAL_STATUSES:
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

    def model_versions(self) -> str:
        """MODELS_FILE's versioned models pinned to the versions new batches use ("name=v ..."); blank
        without versioned models. A models file the service cannot read leaves the pin to the run."""
        try:
            return resolved_pins(engine_settings_from_env(), self.store.output_root)
        except ConfigError as e:
            log.error("model versions not pinned at create (%s); the run resolves them when it starts", e)
            return ""

    def create_batch(self, tenant: str, body: dict[str, Any]) -> BatchObject:
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
        # model_versions: the versions the alias names now: this batch keeps them, whatever is switched later.
        record = BatchRecord(id=batch_id, tenant=tenant, input_file_id=source.id, input_uri=source.uri,
                             endpoint=endpoint, completion_window=window, metadata=metadata, priority=priority,
                             created_at=int(now), expires_at=int(now) + self.windows[window], date=date,
                             output_uri=storage.join(self.store.output_root, date, batch_id), run_id=None,
                             **options, model_versions=self.model_versions() or None)
        self.store.add_batch(record)  # first: a crash before the run is submitted leaves a failed batch, not none
        try:
            record.run_id = self.dagster.submit(record)
        except Exception as e:  # noqa: BLE001
            record.submit_error = f"{type(e).__name__}: {str(e)[:300]}"
            self.store.save_batch(record)
            log.error("batch %s: the run could not be submitted (%s)", batch_id, type(e).__name__)
            raise ApiError(503, "the batch could not be queued: the Dagster instance is not reachable; try again",
                           type_="server_error") from None
        self.store.save_batch(record)
        log.info("batch %s: run %s for file %s, tenant %s", batch_id, record.run_id, source.id, tenant)
        return self.batch_object(record)

    def get_batch(self, tenant: str, batch_id: str) -> BatchRecord:
        record = self.store.batch(tenant, batch_id)
        if record is None:
            raise ApiError(404, f"no batch {batch_id!r}", param="batch_id", code="not_found")
        return record

    def cancel_batch(self, tenant: str, batch_id: str) -> BatchObject:
        record = self.get_batch(tenant, batch_id)
        current = self.batch_object(record)
        if current.status in TERMINAL_STATUSES:
            raise ApiError(400, f"batch {batch_id} is {current.status}: it cannot be cancelled")
        record.cancelling_at = int(time.time())
        self.store.save_batch(record)
        if record.run_id:  # the run keeps its answers, reports the rest cancelled
            self.terminate(record)
        log.info("batch %s: cancel requested", batch_id)
        return self.batch_object(record)

    def terminate(self, record: BatchRecord, wait: float = TERMINATE_WAIT) -> None:
        """Ask Dagster to terminate the batch's run. Dagster refuses while the run is STARTING (its worker
        coming up): this waits up to `wait` seconds for it to start, else records `terminate_pending`,
        and the next read of the batch (retrieve, list) that finds the run started terminates it."""
        deadline = time.monotonic() + wait
        while True:
            run_id, run_status = self.dagster.current_run(record)
            if run_status in ("SUCCESS", "FAILURE", "CANCELED", "CANCELING"):
                break
            # STARTING: Dagster refuses to terminate it yet; RETRYING: the run is failed and its retry
            # not queued yet, so there is nothing to terminate until the retry appears.
            if run_status not in ("STARTING", RETRYING):
                try:
                    self.dagster.terminate_run(run_id)
                    break
                except Exception as e:  # noqa: BLE001 - STARTING by now: wait as below; anything else is an error
                    if "STARTING" not in str(e):
                        # Dagster marks the run CANCELING before it asks the code server to interrupt
                        # it; if that ask failed ("Unable to terminate run"), the run's own watch stops
                        # it (defs/run_watch.py): the cancel is taken, not a 500.
                        if self.dagster.current_run(record)[1] in ("CANCELING", "CANCELED"):
                            log.warning("batch %s: run %s marked cancelling, but Dagster could not interrupt it "
                                        "(%s); the run stops itself", record.id, run_id, str(e)[:200])
                            break
                        raise
            if time.monotonic() >= deadline:
                if not record.terminate_pending:
                    record.terminate_pending = True
                    self.store.save_batch(record)
                    storage.write_json(self._pending_uri(record.id),
                                       PendingTermination(id=record.id, tenant=record.tenant).stored())
                    log.info("batch %s: run %s still starting; terminated once started", record.id, run_id)
                return
            time.sleep(1)
        if record.terminate_pending:
            record.terminate_pending = None
            self.store.save_batch(record)
            storage.delete(self._pending_uri(record.id))

    def _pending_uri(self, batch_id: str) -> str:
        return storage.join(self.store.output_root, "_batch_api", PENDING_FOLDER, f"{batch_id}.json")

    def sweep_pending_terminations(self) -> int:
        """Terminate the runs whose cancel came while Dagster was still starting them, once they have
        started, without waiting for a client to read the batch: `batch-pipeline serve` calls this every
        SWEEP_SECONDS. Reads only the pending markers (none, usually). Returns the runs terminated."""
        done = 0
        folder = storage.join(self.store.output_root, "_batch_api", PENDING_FOLDER) + "/"
        for info in storage.list_objects(folder, suffix=".json"):
            marker = PendingTermination.model_validate(storage.read_json(info.uri))
            record = self.store.batch(marker.tenant, marker.id)
            if record is None or not record.terminate_pending:
                storage.delete(info.uri)  # read and carried out meanwhile (or the batch is gone)
                continue
            self.terminate(record, wait=0)
            done += 0 if record.terminate_pending else 1
        return done

    def run_of(self, record: BatchRecord) -> tuple[str, str | None]:
        """The run carrying the batch, (run id, status); a cancel that came while the run was starting
        is carried out here, once the run has started."""
        run_id, run_status = self.dagster.current_run(record)
        if record.terminate_pending and run_status not in (None, "STARTING", RETRYING):
            self.terminate(record, wait=0)
            run_id, run_status = self.dagster.current_run(record)
        return run_id, run_status

    def batch_object(self, record: BatchRecord) -> BatchObject:
        """The OpenAI Batch object: the pipeline's batch.json once written, else the run's status. A batch
        seen finished for the first time leaves its tenant's open batches (the limit check's index)."""
        had_failure = record.run_failure
        batch = status.batch_object(record, self.run_of, self.dagster.failure_reason)
        if batch.status in TERMINAL_STATUSES:
            if record.run_failure != had_failure and not record.open:
                self.store.save_batch(record)  # why its run failed, read once (close_batch saves an open one)
            self.store.close_batch(record)
        else:
            self.store.reopen_batch(record)  # only one seen finished: reported failed, then retried after all
        return batch

"""What a run watches in Dagster's instance while it answers: a cancel whose interrupt never reaches it
(`CancelWatch`), and runs of higher priority answering on its warm engine (`PriorityWatch`).

A run that Dagster marks as cancelling stops answering, even when Dagster's interrupt never reaches it.

Dagster terminates a run in two moves: it marks the run CANCELING in the instance, then asks the code
server that launched the run to interrupt the run's worker (SIGINT). When the second move is lost (the
code server was restarted, or no longer knows the run), the run goes on answering while every page says
"Canceling", holding its GPU and run slot. `CancelWatch` closes that gap: a thread reads the run's
status every POLL_SECONDS; once the run has been CANCELING for GRACE_SECONDS (Dagster's own interrupt
lands well within that), it logs so and `requested()` turns True. The answering loop asks after every
answer (steps/inference.py's `cancelled`) and stops as a cancel from the UI does: every answer kept,
the batches reported cancelled, the next run resuming the rest. The interrupt stays the first way.

A run on a warm engine gives way to a more urgent one there. vLLM's priority orders only its waiting
queue, so an urgent batch arriving while a bulk batch's requests fill the running batch shares every
decode step with them (engine/remote.py, "Yielding"). While a run answers on a warm engine it carries
the tag ANSWERING_TAG (the engine's URL); `PriorityWatch` reads the started runs with that tag every
PRIORITY_POLL_SECONDS, and while one of a higher priority (config/priority.py's scale) is among
them, the run pulls back its requests in flight and keeps few at the server. Dagster is the one place every run of every trigger
(Batch API, schedule, sensor, UI) is known, so no other coordination is needed.

It gives way from the urgent run's start, not only once that run answers: a run launched on this
instance with WARM_ENGINE_TAG (the engine its requests will go to: ENGINE_URL, on both jobs) that has
not begun answering counts for its first STARTING_GRACE_SECONDS. The seconds from its launch to its
first request (a process forked, resources opened, its file read and validated) then run beside a
run that keeps 2 requests in flight rather than a whole window, whose answers also take CPU on the
host (the server's detokenizing, the run's checkpoints): 1-2.5 s of an urgent batch of 8 lines there.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg

from batch_pipeline.config.priority import run_priority
from batch_pipeline.engine.remote import RemoteEngines

POLL_SECONDS = 5.0
GRACE_SECONDS = 10.0
# The warm engine a run is answering on now (its URL; blank once it has stopped answering).
ANSWERING_TAG = "batch_pipeline/answering_on"
# The warm engine a run's requests will go to (ENGINE_URL when the definitions loaded; defs/jobs.py).
WARM_ENGINE_TAG = "batch_pipeline/warm_engine"
# How long a started run of higher priority that has not begun answering on the engine counts: a run
# whose lines all go elsewhere, or that only validates for minutes, does not hold the others back.
STARTING_GRACE_SECONDS = 30.0
# A quarter of a second: at a 1 s poll an urgent run shares half a second of the bulk run's decode
# steps on average before it is seen (bench/api_burst.py --priority-only, 3 rounds each: the urgent
# inference step 1.8-2.0 s beside a bulk one against 2.1-3.0 s at 1 s; 0.9-1.0 s alone). It costs the
# instance 4 looks a second per run up to the cap below (0.29 CPU-s/s at 8 runs against 0.09 at 1 s).
PRIORITY_POLL_SECONDS = 0.25
# A write to the run's tags tried this many times, this far apart: a throwaway instance's in-memory
# tables (`batch-pipeline run` without DAGSTER_HOME) refuse a write at once ("database table is
# locked") while another thread of the run reads them (a watch's look).
WRITE_TRIES, WRITE_PAUSE_SECONDS = 20, 0.05
# Every watch on one engine reads all the runs answering there, so K runs looking every second cost K^2
# (bench/priority_watch_load.py on PostgreSQL, 2 cores: 0.05 CPU-s/s at 3 runs, 0.5 at 25, about 3 at
# 100, where the looks fell behind). A watch seeing K runs looks every K / PRIORITY_LOOKS_PER_SECOND
# seconds when that is longer than its poll (from 7 runs on): an engine's watches then look at most
# that often in all, and an urgent run among 100 is seen within 4 s. (A look reads at most 100 runs, so beyond 100 runs on one engine the
# looks grow again with K: deploy/dagster.yaml lets 8 run at once, dagster.yaml 3.)
PRIORITY_LOOKS_PER_SECOND = 25.0


class CancelWatch:
    """Watches one run's status in `instance`; `requested()` says whether it was seen cancelling for
    longer than the grace."""

    def __init__(self, instance: Any, run_id: str, log: Callable[[str], None],
                 poll: float | None = None, grace: float | None = None) -> None:
        self.instance, self.run_id, self.log = instance, run_id, log
        self.poll = POLL_SECONDS if poll is None else poll
        self.grace = GRACE_SECONDS if grace is None else grace
        self._seen = threading.Event()
        self._done = threading.Event()

    def requested(self) -> bool:
        return self._seen.is_set()

    def _watch(self) -> None:
        since: float | None = None
        while not self._done.wait(self.poll):
            try:
                run = self.instance.get_run_by_id(self.run_id)
            except Exception:  # noqa: BLE001 - the instance busy or restarting: ask again at the next poll
                continue
            if run is None or run.status != dg.DagsterRunStatus.CANCELING:
                since = None
                continue
            since = time.monotonic() if since is None else since
            if time.monotonic() - since >= self.grace and not self._done.is_set():
                self.log(f"this run has been cancelling for over {self.grace:g}s without Dagster's interrupt "
                         "reaching it: answering stops here (every answer so far is kept)")
                self._seen.set()
                return

    @contextmanager
    def running(self) -> Iterator["CancelWatch"]:
        """The watch thread, for the duration of the block."""
        thread = threading.Thread(target=self._watch, name="cancel-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._done.set()
            thread.join(timeout=10)  # no read of the instance left under the run's next writes


class PriorityWatch:
    """Tags a run as answering on a warm engine and watches the other runs answering there;
    `outranked()` names one of a higher priority, or is None."""

    def __init__(self, instance: Any, run: Any, url: str, poll: float | None = None) -> None:
        self.instance, self.run_id, self.url = instance, run.run_id, url
        self.priority = run_priority(run.tags)
        self.poll = PRIORITY_POLL_SECONDS if poll is None else poll
        self._above: str | None = None
        self._answering = 1  # runs answering on the engine at the last look, this one included
        self._done = threading.Event()

    def outranked(self) -> str | None:
        return self._above

    def look(self, now: float | None = None) -> str | None:
        """The runs answering on this engine now, and those launched to answer there that have not begun
        (for their first STARTING_GRACE_SECONDS after their launch, reckoned from `now`, Unix time):
        a sentence naming the most urgent one above this run's priority, or None."""
        records = self.instance.get_run_records(filters=dg.RunsFilter(
            statuses=[dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]), limit=100)
        now, above, answering = time.time() if now is None else now, [], 0
        for record in records:
            run = record.dagster_run
            if run.tags.get(ANSWERING_TAG) == self.url:
                answering += 1
                doing = "is answering"
            elif ANSWERING_TAG not in run.tags and run.tags.get(WARM_ENGINE_TAG) == self.url:
                if now - _started_at(record) > STARTING_GRACE_SECONDS:
                    continue
                doing = "is starting"
            else:
                continue
            if run.run_id != self.run_id and run_priority(run.tags) > self.priority:
                above.append((run_priority(run.tags), doing == "is answering", run.run_id, doing))
        self._answering = max(1, answering)
        if not above:
            return None
        priority, _, run_id, doing = max(above)
        return f"run {run_id} (priority {priority}, this run's {self.priority}) {doing} on {self.url}"

    def interval(self) -> float:
        """Seconds to the next look: the poll, longer when many runs answer on the engine (see
        PRIORITY_LOOKS_PER_SECOND)."""
        return max(self.poll, self._answering / PRIORITY_LOOKS_PER_SECOND)

    def _watch(self) -> None:
        while not self._done.wait(self.interval()):
            try:
                self._above = self.look()
            except Exception:  # noqa: BLE001 - the instance busy or restarting: ask again at the next poll
                continue

    @contextmanager
    def answering(self) -> Iterator["PriorityWatch"]:
        """The tag and the watch thread, for the duration of the block."""
        tag_run(self.instance, self.run_id, {ANSWERING_TAG: self.url})
        thread = threading.Thread(target=self._watch, name="priority-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._done.set()
            thread.join(timeout=10)
            try:
                tag_run(self.instance, self.run_id, {ANSWERING_TAG: ""})
            except Exception:  # noqa: BLE001 - the run ends soon anyway: a started run's tag is what counts
                pass


def tag_run(instance: Any, run_id: str, tags: dict[str, str]) -> None:
    """`add_run_tags`, tried again while the instance refuses the write for a moment (WRITE_TRIES);
    the last refusal is raised."""
    for attempt in range(WRITE_TRIES):
        try:
            instance.add_run_tags(run_id, tags)
            return
        except Exception:  # noqa: BLE001 - sqlalchemy's OperationalError, whatever the storage
            if attempt == WRITE_TRIES - 1:
                raise
            time.sleep(WRITE_PAUSE_SECONDS)


def _started_at(record: Any) -> float:
    """When a run started (Unix time): its start, or while STARTING its last update (the launch; a
    run's creation may be long before, in the queue). Dagster's storage keeps naive UTC times, the
    update to the second on SQLite: well within STARTING_GRACE_SECONDS."""
    if record.start_time:
        return float(record.start_time)
    updated = record.update_timestamp
    return (updated if updated.tzinfo else updated.replace(tzinfo=dt.timezone.utc)).timestamp()


@contextmanager
def yielding_to_urgent_runs(instance: Any, run: Any, engines: Any) -> Iterator[None]:
    """While the block runs, a run answering on a warm engine keeps few requests in flight whenever a
    run of higher priority answers there too; a run answering in-process watches nothing."""
    if not isinstance(engines, RemoteEngines):
        yield
        return
    watch = PriorityWatch(instance, run, engines.url)
    with watch.answering():
        engines.outranked = watch.outranked
        try:
            yield
        finally:
            engines.outranked = lambda: None

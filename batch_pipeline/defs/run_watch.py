"""A run that Dagster marks as cancelling stops answering, even when Dagster's interrupt never reaches it.

Dagster terminates a run in two moves: it marks the run CANCELING in the instance, then asks the code
server that launched the run to interrupt the run's worker (SIGINT). When the second move is lost (the
code server was restarted, or no longer knows the run), the run goes on answering while every page says
"Canceling", holding its GPU and run slot. `CancelWatch` closes that gap: a thread reads the run's
status every POLL_SECONDS; once the run has been CANCELING for GRACE_SECONDS (Dagster's own interrupt
lands well within that), it logs so and `requested()` turns True. The answering loop asks after every
answer (steps/inference.py's `cancelled`) and stops as a cancel from the UI does: every answer kept,
the batches reported cancelled, the next run resuming the rest. The interrupt stays the first way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg

POLL_SECONDS = 5.0
GRACE_SECONDS = 10.0


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

"""Progress of long work in the log: a steady cadence of rate and ETA, and capped per-line logging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Log = Callable[[str], None]
PROGRESS_SECONDS = 10.0
# Held while Python's logging is being reconfigured (vllm_adapter.configure_vllm_logging): heartbeat
# threads wait for it before they log. logging.config.dictConfig holds logging's module lock while it
# takes each handler's lock; a thread logging at that moment through a handler that logs itself
# (Dagster's event log handler: its storage logs through SQLAlchemy) holds its handler's lock and
# waits for the module lock, so both threads wait for ever (a run hung in its model load that way).
LOGGING_SETUP = threading.Lock()


def quiet(_message: str) -> None:
    return None


class Progress:
    """Rate and ETA for long work, logged every `every` seconds and at the end."""

    def __init__(self, total: int, done: int, log: Log, label: str, every: float = PROGRESS_SECONDS):
        self.total, self.log, self.label, self.every = total, log, label, every
        self.resumed = self.done = done
        self.output_tokens = 0
        self.images = 0  # images in the prompts of the requests done (vision-language lines)
        self.started = self._last = time.monotonic()
        self.excluded = 0.0  # model loading, kept out of the rate

    def advance(self, completion_tokens: int, images: int = 0) -> None:
        self.done += 1
        self.output_tokens += completion_tokens
        self.images += images
        if self.done == self.resumed + 1:
            self._last = time.monotonic()  # the cadence starts with the first answer, not the model load
        if time.monotonic() - self._last >= self.every or self.done == self.total:
            self.report()

    def report(self) -> None:
        self._last = time.monotonic()
        elapsed = max(self._last - self.started - self.excluded, 1e-9)
        rate = (self.done - self.resumed) / elapsed
        eta = f"{(self.total - self.done) / rate:.0f}s" if rate > 0 else "unknown"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        resumed = f", {self.resumed} resumed from checkpoints" if self.resumed else ""
        pictures = f", {self.images} images ({self.images / elapsed:.2f}/s)" if self.images else ""
        self.log(
            f"{self.label}: {self.done}/{self.total} requests ({pct:.0f}%){pictures}, {rate:.2f} req/s, "
            f"{self.output_tokens / elapsed:.1f} output tok/s, ETA {eta}{resumed}"
        )


def first_n_logger(log: Log, limit: int) -> Log:
    """Log the first `limit` messages and then say that the rest are in the error file."""
    count = 0

    def limited(message: str) -> None:
        nonlocal count
        count += 1
        if count <= limit:
            log(message)
        elif count == limit + 1:
            log(f"more than {limit} invalid lines; the rest are listed in errors.jsonl only")

    return limited


@contextmanager
def heartbeat(log: Log, what: str, phase: Callable[[], str] = lambda: "", every: float = PROGRESS_SECONDS) -> Iterator[None]:
    """Log `what`, the current `phase()` and the time so far every `every` seconds while the block
    runs (a model load says nothing for a minute otherwise)."""
    started = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            current = phase()
            with LOGGING_SETUP:
                if not done.is_set():
                    log(f"{what}: {current + ', ' if current else ''}{time.monotonic() - started:.0f}s so far")

    thread = threading.Thread(target=beat, name="batch-pipeline-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)

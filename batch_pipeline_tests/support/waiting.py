"""The one way a test waits for something to happen: `wait_for`, a condition polled until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0,
             on_timeout: Callable[[], str] | None = None) -> T:
    """Call `probe` every `interval` seconds until it returns something truthy, and return that.

    After `timeout` seconds, raise TimeoutError naming `what` (the thing awaited, e.g. "the first
    checkpoint part") with `on_timeout()`'s text: the state then (a server's log tail, a process's
    last lines)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}" + (f"\n{detail}" if detail else ""))
        time.sleep(interval)  # the poll interval

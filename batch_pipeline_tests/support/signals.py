"""The signal state a user's terminal gives a command, for the processes tests start as a user would.

Two things otherwise leak from the test process into what it starts, both inherited across exec:
an ignored disposition (a shell starts background jobs with SIGINT and SIGQUIT ignored; a harness
or a library may leave SIGTERM ignored) and a blocked signal mask. A process started with either
ignores the Ctrl-C or the stop a test sends it, and the test then waits out its grace and fails
on something the product never sees (a user's shell starts `make dev` with neither). CPython also
installs its KeyboardInterrupt handler only when SIGINT is not ignored at start."""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)


def as_from_a_terminal() -> None:
    """A `preexec_fn`: SIGINT, SIGTERM and SIGQUIT to their defaults, no signal blocked."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())

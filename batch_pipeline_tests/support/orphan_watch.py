"""Stops a test server's process group once the test process that owns it is gone.

    python orphan_watch.py OWNER_PID PGID [GRACE]

A server a test starts runs in a process group of its own (so that it can be stopped whole), which
also means it outlives its owner: a pytest killed with SIGKILL never runs its teardown, and the
server (a vLLM engine holding GiBs) would stay up until the machine restarts. This watcher runs beside
it in a session of its own: every POLL seconds it looks at both; when the owner is gone it sends the
group SIGTERM, then SIGKILL after GRACE seconds; when the group is gone it exits. A plain script
(no imports of the project), so it starts in milliseconds wherever the tests run from."""

import os
import signal
import sys
import time

POLL = 1.0  # seconds between looks: a poll interval, no test waits on it
GRACE = 30.0  # seconds between SIGTERM and SIGKILL, as the tests' own stop gives


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def main(owner: int, pgid: int, grace: float = GRACE) -> int:
    while group_alive(pgid):
        if not alive(owner):
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    return 0
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and group_alive(pgid):
                    time.sleep(0.2)  # a poll interval while the group stops
            return 0
        time.sleep(POLL)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), *(float(a) for a in sys.argv[3:4])))

"""The test suite's own servers do not outlive it: a vLLM server a test starts runs in a process
group of its own, and a watcher (support/orphan_watch.py) stops that group once the process that
owns it is gone, even killed with SIGKILL, when no teardown runs.

Plain `sleep` processes stand in for the server and its owner (the watcher only looks at process ids),
started with a terminal's signals (support/signals.py), as a real server sets its own;
the real servers take the same path (support/warm_engine.py's WarmServer starts one watcher each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from batch_pipeline_tests.support import wait_for
from batch_pipeline_tests.support.orphan_watch import group_alive
from batch_pipeline_tests.support.signals import as_from_a_terminal
from batch_pipeline_tests.support.warm_engine import watch_group

# Servers started, killed and waited out in processes of their own (2-4 s each): not in `make test-fast`.
pytestmark = pytest.mark.slow


def _server(*command: str) -> subprocess.Popen:
    """A stand-in server in a process group of its own, with a child of its own (as vLLM's API server
    has its engine core), returned once it has run `command` and started the child."""
    code = ("import subprocess, sys, time; "
            f"{'; '.join(command) or 'pass'}; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print('ready', flush=True); time.sleep(600)")
    server = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True,
                              preexec_fn=as_from_a_terminal)
    assert server.stdout.readline() == "ready\n"
    return server


def _reaped(process: subprocess.Popen) -> bool:
    return process.poll() is not None


def test_a_server_is_stopped_whole_when_its_owner_is_killed():
    owner = subprocess.Popen(["sleep", "600"], preexec_fn=as_from_a_terminal)
    server = _server()
    watcher = watch_group(owner.pid, server.pid)
    try:
        assert len(_group_pids(server.pid)) == 2  # the server and its child
        assert watcher.poll() is None  # the owner lives: the watcher leaves the server alone
        owner.kill()
        owner.wait(10)
        wait_for("the server's process group gone", lambda: _reaped(server) and not group_alive(server.pid), 30,
                 interval=0.2)
        assert server.returncode == -signal.SIGTERM
        wait_for("the watcher gone", lambda: _reaped(watcher), 10, interval=0.2)
    finally:
        for process in (owner, server, watcher):
            if process.poll() is None:
                process.kill()


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace():
    owner = subprocess.Popen(["sleep", "600"], preexec_fn=as_from_a_terminal)
    server = _server("import signal", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    watcher = watch_group(owner.pid, server.pid, grace=2.0)
    try:
        owner.kill()
        owner.wait(10)
        wait_for("the server's process group gone", lambda: _reaped(server) and not group_alive(server.pid), 30,
                 interval=0.2)
        assert server.returncode == -signal.SIGKILL
    finally:
        for process in (owner, server, watcher):
            if process.poll() is None:
                process.kill()


def test_the_watcher_leaves_with_a_server_stopped_by_its_owner():
    server = _server()
    watcher = watch_group(os.getpid(), server.pid)
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)
        wait_for("the watcher gone", lambda: _reaped(watcher), 10, interval=0.2)
        assert watcher.returncode == 0
    finally:
        for process in (server, watcher):
            if process.poll() is None:
                process.kill()


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except ProcessLookupError:
                continue
    return pids

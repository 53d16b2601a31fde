"""How a `batch-pipeline` process ends (base/runtime.exit_without_teardown), in plain Python
subprocesses: no engine, no server. The real command on each kind of batch file is tested in
test_cli.py (test_the_command_exits_soon_after_its_results)."""

from __future__ import annotations

import subprocess
import sys
import time

EXITS_WITHIN = 8.0  # seconds; a hang is what is tested for, and the join grace below is 1 s


def run_exiting(body: str, join_seconds: float = 1.0) -> tuple[subprocess.CompletedProcess, float]:
    script = (
        "import concurrent.futures, threading, time\n"
        "from batch_pipeline.base.runtime import exit_without_teardown\n"
        f"{body}\n"
        "print('before exit', flush=True)\n"
        f"exit_without_teardown(3, join_seconds={join_seconds})\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def test_an_idle_thread_pool_worker_does_not_hold_the_exit():
    # What the pooling engines left behind (issue #25): a worker waiting on its pool's queue, which
    # only the interpreter's own shutdown wakes. Before the fix this process never ended.
    proc, took = run_exiting("pool = concurrent.futures.ThreadPoolExecutor(2)\n"
                             "assert pool.submit(lambda: 41 + 1).result() == 42")
    assert proc.returncode == 3, proc.stderr
    assert "before exit" in proc.stdout
    assert took < EXITS_WITHIN, f"took {took:.1f}s"
    assert "still running" not in proc.stderr  # the pool's worker ended: it was woken, not abandoned


def test_a_stuck_thread_is_named_and_left_behind():
    proc, took = run_exiting("threading.Thread(target=threading.Event().wait, name='stuck-worker').start()")
    assert proc.returncode == 3, proc.stderr
    assert took < EXITS_WITHIN, f"took {took:.1f}s"
    assert "1 thread(s) still running after 1s: stuck-worker" in proc.stderr


def test_a_thread_finishing_its_work_is_waited_for():
    # A non-daemon thread that is still writing when the main thread ends gets to finish.
    proc, _ = run_exiting("def work():\n    time.sleep(0.5)\n    print('worker done', flush=True)\n"
                          "threading.Thread(target=work).start()", join_seconds=5.0)
    assert proc.returncode == 3 and "worker done" in proc.stdout, proc.stderr
    assert "still running" not in proc.stderr


def test_atexit_handlers_and_buffered_output_are_not_lost():
    proc, _ = run_exiting("import atexit, sys\natexit.register(lambda: print('atexit ran'))\nsys.stdout.write('buffered')")
    assert proc.returncode == 3
    assert "buffered" in proc.stdout and "atexit ran" in proc.stdout

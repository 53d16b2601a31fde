"""The process environment vLLM runs in, and what hardware there is to run on."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def runtime_env(cache_root: Path) -> dict[str, str]:
    """Variables that keep vLLM and Hugging Face inside our cache and away from the network."""
    return {
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        "HF_HOME": str(cache_root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def configure_runtime_env(cache_root: Path, engine_here: bool = True) -> None:
    """Apply runtime_env() where not set already; on CPU also run the engine core in-process.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 set by the user keeps vLLM's own default (the engine core in
    a child process, as on GPUs); the tests run that mode on the CPU too. `engine_here` False (a
    run that sends to a warm engine): no engine is built in this process, so torch is not imported
    to ask whether there are GPUs (1.5-4 s of a file run's start on 2 cores); call it again with
    True before building one.
    """
    defaults = runtime_env(cache_root)
    if engine_here and is_cpu():
        # In-process engine core: ~3 s start for a tiny model instead of ~50 s.
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for importing torch and vLLM, which create hundreds of
    thousands of long-lived objects and would otherwise trigger a full collection again and again
    (about 1 s of a 25 s run measured on 2 cores; see docs/PERFORMANCE.md). Reference counting still
    frees what it can; a collection runs as usual once the block ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def peak_memory_mb() -> float:
    # ru_maxrss is in KiB on Linux: the process-wide peak, engine included.
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def gpu_count() -> int:
    """CUDA devices torch can use (0 on a CPU build or a machine without GPUs)."""
    try:
        with gc_paused():
            import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a dependency of both extras
        return 0


def is_cpu() -> bool:
    return gpu_count() == 0


# How long exit_without_teardown waits for other threads before ending the process anyway.
EXIT_JOIN_SECONDS = 10.0


def exit_without_teardown(code: int, join_seconds: float = EXIT_JOIN_SECONDS) -> None:
    """End the process as the interpreter would, minus its teardown: with torch, vLLM and Dagster
    loaded, tearing down modules runs full garbage collections over ~1M objects (2.2-2.6 s measured
    on 2 cores, a tenth of a 192-request run). Output is flushed, atexit handlers run (Dagster's
    temporary folders, logging, vLLM's finalizers), and no thread can hold the exit:

    - Idle thread-pool workers (concurrent.futures, e.g. left by a pooling engine) only end when
      the interpreter's shutdown wakes them, through the callbacks registered with
      `threading._register_atexit`, which `atexit._run_exitfuncs()` does not run. They are run
      first here, as `threading._shutdown()` runs them (see _run_thread_atexits).
    - Any other non-daemon thread is waited for `join_seconds` in all, then named on stderr and
      left behind: a script or cron job calling the CLI must get its exit code.
    """
    _run_thread_atexits()
    deadline = time.monotonic() + join_seconds
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(timeout=max(deadline - time.monotonic(), 0.0))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if stuck:
        print(f"exiting with {len(stuck)} thread(s) still running after {join_seconds:.0f}s: {', '.join(stuck)}",
              file=sys.stderr)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_thread_atexits() -> None:
    """What the interpreter's shutdown does before joining threads: the callbacks registered with
    `threading._register_atexit` (concurrent.futures' wake-up of idle pool workers), newest first.
    A private list of the threading module (CPython 3.9+); test_runtime.py pins that an idle
    ThreadPoolExecutor worker no longer holds the exit, so a Python that changes it fails there."""
    for callback in reversed(getattr(threading, "_threading_atexits", [])):
        try:
            callback()
        except Exception:  # noqa: BLE001 - one callback failing must not keep the others from running
            pass

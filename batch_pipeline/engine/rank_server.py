"""Imported by the ranks' fork server (ranks.RANK_PRELOAD) before it forks any rank: vLLM, once,
with Python's collector paused as a run's own import is (vllm_adapter.import_vllm).

The server imports with one OpenMP thread (OMP_NUM_THREADS=1). Importing torch otherwise starts
OpenMP's thread pool, and a pool started before fork() is not whole in the forked process: ranks
forked from such a server answered 9 times slower (bench/data_parallel.py, 2 ranks on a 2-core
machine). Each rank puts the run's own value back, and torch's thread count as a new process on
the rank's cores would have it, before its engine is built (restore_environment); vLLM then sizes
and binds the engine's threads itself.

An error in the import is not this server's to report: it is swallowed, and each rank then imports
vLLM itself and reports the error as its own, naming its rank.
"""

import os

RUN_OMP_NUM_THREADS = os.environ.get("OMP_NUM_THREADS")  # the run process's, for its ranks
os.environ["OMP_NUM_THREADS"] = "1"

from batch_pipeline.engine import vllm_adapter  # noqa: E402 - after the thread count above

try:
    vllm_adapter.import_vllm()
except Exception:  # noqa: BLE001 - see the module's docstring
    pass


def restore_environment() -> None:
    """In a rank forked from the server, once placed on its cores: the run's OMP_NUM_THREADS back, and
    torch's threads as a new process there would have them (the run's value, else one per core the
    rank may use; vLLM then sizes its engine's own from these)."""
    if RUN_OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = RUN_OMP_NUM_THREADS
    try:
        threads = int(RUN_OMP_NUM_THREADS) if RUN_OMP_NUM_THREADS else len(os.sched_getaffinity(0))
    except ValueError:  # not a number: torch ignores such a value too
        threads = len(os.sched_getaffinity(0))
    try:
        import torch

        torch.set_num_threads(max(threads, 1))
    except ImportError:  # the server's import failed: the rank imports vLLM itself, and reports it
        pass

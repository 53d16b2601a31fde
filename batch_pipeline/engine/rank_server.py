"""Imported by the ranks' fork server (ranks.RANK_PRELOAD) before it forks any rank: vLLM, once,
with Python's collector paused as a run's own import is (vllm_adapter.import_vllm).

The server imports with one OpenMP thread (OMP_NUM_THREADS=1). Importing torch otherwise starts
OpenMP's thread pool, and a pool started before fork() is not whole in the forked process: ranks
forked from such a server answered 9 times slower (bench/data_parallel.py, 2 ranks on this 2-core
machine). Each rank puts the run's own value back before its engine is built (restore_environment);
vLLM sizes and binds the engine's threads itself (on CPU to the rank's cores, on a GPU to one).

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
    """In a rank forked from the server: the run's OMP_NUM_THREADS, in the environment and in torch."""
    if RUN_OMP_NUM_THREADS is None:
        os.environ.pop("OMP_NUM_THREADS", None)
        return
    os.environ["OMP_NUM_THREADS"] = RUN_OMP_NUM_THREADS
    try:
        import torch

        torch.set_num_threads(int(RUN_OMP_NUM_THREADS))
    except (ImportError, ValueError):  # not a number: torch ignores such a value too
        pass

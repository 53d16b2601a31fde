"""The process environment vLLM runs in, and what hardware there is to run on."""

from __future__ import annotations

import os
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


def configure_runtime_env(cache_root: Path) -> None:
    """Apply runtime_env() where not set already; on CPU also run the engine core in-process.

    VLLM_ENABLE_V1_MULTIPROCESSING=1 set by the user keeps vLLM's own default (the engine core in
    a child process, as on GPUs); the tests run that mode on the CPU too.
    """
    defaults = runtime_env(cache_root)
    if is_cpu():
        # In-process engine core: ~3 s start for a tiny model instead of ~50 s.
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def gpu_count() -> int:
    """CUDA devices torch can use (0 on a CPU build or a machine without GPUs)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:  # pragma: no cover - torch is a dependency of both extras
        return 0


def is_cpu() -> bool:
    return gpu_count() == 0

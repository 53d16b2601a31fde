"""Named engine presets (ENGINE_PRESET): starting points for common hardware, arithmetic in docs/GPU.md.

A preset only fills in defaults: every variable set explicitly (BATCH_SIZE, MAX_MODEL_LEN, ...)
still wins over it.
"""

from __future__ import annotations

import copy
from typing import Any

from batch_pipeline.base.errors import ConfigError

# What every GPU preset shares: bf16, 8k context, most of the GPU's memory, prefix caching and
# chunked prefill (prefill interleaved with decode).
_GPU: dict[str, Any] = {
    "dtype": "bfloat16",
    "max_model_len": 8192,
    "batch_size": 256,
    "max_num_batched_tokens": 16384,
    "gpu_memory_utilization": 0.92,
    "enable_prefix_caching": True,
    "extra_engine_args": {"enable_chunked_prefill": True},
}

PRESETS: dict[str, dict[str, Any]] = {
    # These machines: fp32 (bf16 ran ~10x slower on these CPUs), eager mode (compiling took ~50 s).
    "cpu": {"dtype": "float32", "enforce_eager": True},
    # Llama-3.1-8B-Instruct class model on one H100 80 GB: ~16 GB of bf16 weights leave ~50 GB of
    # KV cache (~400k tokens at 128 KiB/token), enough for 256 sequences of 1.5k tokens.
    "h100-8b": {**_GPU},
    # The same model on one H200 141 GB: ~110 GB of KV cache (~840k tokens), twice the sequences.
    "h200-8b": {**_GPU, "batch_size": 512, "max_num_batched_tokens": 32768},
    # A 70B model (~140 GB in bf16) needs tensor parallelism: 4 x H100 80 GB.
    "h100x4-70b": {**_GPU, "tensor_parallel_size": 4},
}


# The hardware each preset is written for: (GPUs it needs, what they are). "cpu" needs none.
HARDWARE: dict[str, tuple[int, str]] = {
    "cpu": (0, "CPU"),
    "h100-8b": (1, "1 x H100 80 GB"),
    "h200-8b": (1, "1 x H200 141 GB"),
    "h100x4-70b": (4, "4 x H100 80 GB"),
}


def preset(name: str) -> dict[str, Any]:
    try:
        return copy.deepcopy(PRESETS[name])  # the presets share nested dicts
    except KeyError:
        raise ConfigError(f"ENGINE_PRESET={name!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}") from None

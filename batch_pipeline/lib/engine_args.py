"""vLLM engine arguments from our settings: one typed place, as vLLM's own EngineArgs.

CPU defaults (a machine without a GPU, where vLLM cannot size the KV cache from device memory):
fp32 (bf16 ran ~10x slower on the CPUs measured), eager mode (compiling took ~50 s to start), and a
1 GiB KV cache, raised to hold two sequences of the full context when the model needs more.
Measured with the bundled SmolLM2-135M (46 KB of KV per token) on 2 cores: building the engine took
4.2 s with 1 GiB against 5.8 s with the former 2 GiB default, and 1 GB less memory; the context
length itself (2048 or the model's 8192) changed the start by well under a second. 1 GiB holds
~23k tokens of that model: 256 sequences of ~90 tokens decoding together, more than 2 CPU cores
keep busy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batch_pipeline.lib.presets import HARDWARE
from batch_pipeline.lib.runtime import gpu_count, is_cpu
from batch_pipeline.lib.settings import ConfigError, EngineSettings

CPU_KV_CACHE_BYTES = 2**30
CPU_EMBEDDING_KV_CACHE_BYTES = 256 * 2**20


def engine_kwargs(settings: EngineSettings, model_path: str, served_name: str, runner: str) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` serving `model_path` with the "generate" or "pooling" runner."""
    cpu = is_cpu()
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": served_name,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "seed": settings.seed,
        "dtype": "float32" if (cpu and settings.dtype == "auto") else settings.dtype,
        "enforce_eager": cpu if settings.enforce_eager is None else settings.enforce_eager,
        "trust_remote_code": False,
    }
    if runner == "pooling":
        kwargs["runner"] = "pooling"
    else:
        optional = {
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.batch_size,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "enable_prefix_caching": settings.enable_prefix_caching,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
    if cpu:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes or (
            cpu_kv_cache_bytes(model_path, settings.max_model_len) if runner == "generate" else CPU_EMBEDDING_KV_CACHE_BYTES
        )
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    kwargs.update(settings.extra_engine_args)
    return kwargs


def cpu_kv_cache_bytes(model_path: str, max_model_len: int | None, fp_bytes: int = 4) -> int:
    """CPU_KV_CACHE_BYTES, or room for two full-context sequences when the model needs more (vLLM
    refuses to start when one sequence of max_model_len does not fit). From config.json; a folder
    without a readable one gets the plain default."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        config = config.get("text_config", config)
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * fp_bytes
        context = int(max_model_len or config.get("max_position_embeddings") or 0)
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_KV_CACHE_BYTES
    return max(CPU_KV_CACHE_BYTES, 2 * context * per_token)


def hardware_problem(settings: EngineSettings, gpus: int | None = None) -> str | None:
    """Why these settings cannot run on this machine's GPUs, or None.

    A GPU preset on a machine without GPUs would otherwise load the model on the CPU with bf16 and
    an 8k context, and run for hours at a fraction of the speed the preset was chosen for.
    """
    gpus = gpu_count() if gpus is None else gpus
    if settings.preset:
        needed, hardware = HARDWARE.get(settings.preset, (0, ""))
        if needed and gpus == 0:
            return (
                f"ENGINE_PRESET={settings.preset} is for {hardware}, but no GPU is visible here; "
                "unset it (or ENGINE_PRESET=cpu) to run on the CPU"
            )
        if needed > gpus:
            return f"ENGINE_PRESET={settings.preset} is for {hardware}, but only {gpus} GPU(s) are visible"
    if gpus and settings.tensor_parallel_size > gpus:
        return f"TENSOR_PARALLEL_SIZE={settings.tensor_parallel_size} but only {gpus} GPU(s) are visible"
    return None


def require_hardware(settings: EngineSettings) -> None:
    """Refuse, before any model is loaded, settings this machine cannot run (ConfigError)."""
    problem = hardware_problem(settings)
    if problem:
        raise ConfigError(problem)

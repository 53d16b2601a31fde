"""The tiny model's names and settings, the session's shared engines (built at most once per model
and test process, shut down by conftest.py's `_runtime_env` when the session ends), and the
environment of a `batch-pipeline` subprocess on the tiny model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from batch_pipeline.defs.resources import LLMResource
from batch_pipeline.engine.vllm_adapter import build_llm, shutdown_llm

REPO = Path(__file__).resolve().parents[2]

TINY_NAME = "tiny-llama"
EMBED_NAME = "all-MiniLM-L6-v2"
TINY_MAX_MODEL_LEN = 512
# Small KV cache: enough for the tests' batches, quick to allocate.
TEST_KV_BYTES = 256 * 2**20

_ENGINES: dict[tuple[str, str, int], Any] = {}


def session_engine(kwargs: dict[str, Any]) -> Any:
    """The session's engine for these engine arguments, built on first use."""
    # An engine with LoRA enabled is a different engine (its own kernels and adapter slots).
    key = (str(kwargs["model"]), kwargs.get("runner", "generate"), kwargs.get("max_loras") if kwargs.get("enable_lora") else 0)
    if key not in _ENGINES:
        _ENGINES[key] = build_llm(kwargs)
    return _ENGINES[key]


def shutdown_session_engines() -> None:
    for llm in _ENGINES.values():
        shutdown_llm(llm)
    _ENGINES.clear()


class SessionLLM(LLMResource):
    """The real LLMResource, except that engines outlive a run: built once, shared by every test."""

    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return session_engine(kwargs)

    def owns_engines(self) -> bool:
        return False

    def rebuilt(self, cls: type["SessionLLM"] | None = None, **overrides: Any) -> "SessionLLM":
        """This resource with some fields changed. Built anew, not model_copy'd: Dagster re-creates
        resources from their original config, so an updated copy would silently lose the change."""
        fields = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        return (cls or type(self))(**{**fields, **overrides})


def tiny_env(tiny_model_dir: Path, **extra: str) -> dict[str, str]:
    """The environment for a `batch-pipeline` subprocess on the tiny model (no DAGSTER_HOME unless given)."""
    env = {
        **os.environ,
        "MODEL_PATH": str(tiny_model_dir),
        "SERVED_MODEL_NAME": TINY_NAME,
        "MAX_MODEL_LEN": str(TINY_MAX_MODEL_LEN),
        "KV_CACHE_MEMORY_BYTES": str(TEST_KV_BYTES),
    }
    env.pop("DAGSTER_HOME", None)
    env.update(extra)
    return env

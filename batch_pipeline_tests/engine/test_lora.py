"""LoRA adapters (LORA_MODULES) served on the generation model, selected per line by body.model.

The adapter is built here in PEFT's format (adapter_config.json + adapter_model.safetensors) for
the tiny random Llama: rank 8 on q_proj and v_proj, with B weights large enough to move the
greedy answer. Base-model lines and adapter lines mix in one batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.io import storage
from batch_pipeline.config.settings import ConfigError
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import TINY_NAME

ADAPTER = "tiny-lora"


def build_lora_adapter(dest: Path, base: Path, rank: int = 8, seed: int = 1) -> Path:
    """A PEFT LoRA adapter for the tiny Llama (hidden 128, 2 layers) on q_proj and v_proj."""
    import torch
    from safetensors.torch import save_file

    if (dest / "adapter_model.safetensors").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator) * 0.5
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base), "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }))
    return dest


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / ADAPTER, tiny_model_dir)


@pytest.fixture(scope="module")
def second_adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_lora_adapter(tmp_path_factory.mktemp("lora") / "other", tiny_model_dir, seed=2)


def line(custom_id: str, model: str, content: str, url: str = contract.CHAT_URL) -> str:
    if url == contract.COMPLETIONS_URL:
        body = {"model": model, "prompt": content, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_adapter_lines_and_base_lines_mix_in_one_batch(tiny_llm, adapter_dir, second_adapter_dir, tmp_path):
    prompts = ["hello there", "what is this", "tell me more"]
    inbox, out = tmp_path / "in", tmp_path / "out"
    # Without LoRA: the base model's answers.
    write_batch(inbox / DATE, "base.jsonl", [line(f"b{i}", TINY_NAME, p) for i, p in enumerate(prompts)])
    assert materialize(tiny_llm, str(inbox), str(out)).success
    plain = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
             for o in read_jsonl(f"{out}/{DATE}/base/output.jsonl")}

    modules = f"{ADAPTER}={adapter_dir},other={second_adapter_dir}"
    with_lora = tiny_llm.rebuilt(lora_modules=modules)
    write_batch(inbox / "2026-11-28", "mixed.jsonl", [
        *(line(f"b{i}", TINY_NAME, p) for i, p in enumerate(prompts)),
        *(line(f"a{i}", ADAPTER, p) for i, p in enumerate(prompts)),
        *(line(f"c{i}", "other", p) for i, p in enumerate(prompts)),
        line("a-completion", ADAPTER, "hello there", url=contract.COMPLETIONS_URL),
        line("unknown", "no-such-adapter", "hello"),
    ])
    assert materialize(with_lora, str(inbox), str(out), partition="2026-11-28").success
    folder = f"{out}/2026-11-28/mixed"
    outputs = {o["custom_id"]: ChatCompletion.model_validate(o["response"]["body"]) for o in read_jsonl(f"{folder}/output.jsonl")
               if o["response"]["body"]["object"] == "chat.completion"}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(f"{folder}/errors.jsonl")}
    base = {k: v.choices[0].message.content for k, v in outputs.items() if k.startswith("b")}
    tuned = {k: v.choices[0].message.content for k, v in outputs.items() if k.startswith("a")}
    assert base == plain  # base-model lines answer as without LoRA
    other = {k: v.choices[0].message.content for k, v in outputs.items() if k.startswith("c")}
    assert all(tuned[f"a{i}"] != base[f"b{i}"] for i in range(3)), (tuned, base)  # the adapter changes each answer
    assert all(other[f"c{i}"] not in (base[f"b{i}"], tuned[f"a{i}"]) for i in range(3)), (other, tuned, base)
    assert {v.model for k, v in outputs.items() if k.startswith("a")} == {ADAPTER}
    assert {v.model for k, v in outputs.items() if k.startswith("b")} == {TINY_NAME}
    [completion] = [o for o in read_jsonl(f"{folder}/output.jsonl") if o["custom_id"] == "a-completion"]
    assert completion["response"]["body"]["model"] == ADAPTER
    assert errors["unknown"]["code"] == contract.MODEL_NOT_FOUND
    assert f"'{TINY_NAME}', '{ADAPTER}', 'other'" in errors["unknown"]["message"]
    batch = json.loads(storage.read_text(f"{folder}/batch.json"))
    assert batch["metadata"]["lora_modules"] == modules


def test_lora_modules_errors_name_the_variable(tiny_llm, tmp_path):
    with pytest.raises(ConfigError, match="LORA_MODULES='just-a-name': 'just-a-name' is not name=path"):
        tiny_llm.rebuilt(lora_modules="just-a-name").settings()
    with pytest.raises(ConfigError, match="is not a LoRA adapter folder"):
        with tiny_llm.rebuilt(lora_modules=f"x={tmp_path}").open(log=lambda _m: None) as engines:
            _ = engines.generation

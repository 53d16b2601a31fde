"""Several generation models (MODELS_FILE): each line runs on the model its body.model names.

The default model is the tiny random Llama; MODELS_FILE adds the bundled SmolLM2 as `smol`. A date
with a file for each model and a file mixing both loads each model once in its run (files are
taken model by model; a mixed file's lines for the other model wait and run after it).
"""

from __future__ import annotations

import json

import dagster as dg
import pytest
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.config.settings import ConfigError, EngineSettings
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import TINY_NAME

FRANCE = "What is the capital of France?"


def line(custom_id: str, model: str, content: str = FRANCE) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": contract.CHAT_URL, "body": body})


@pytest.fixture
def models_file(tmp_path, bundled_model_dir):
    path = tmp_path / "models.yaml"
    path.write_text(f"smol:\n  path: {bundled_model_dir}\n  max_model_len: 2048\n  seed: 7\n")
    return path


def test_each_line_runs_on_the_model_it_names_and_each_model_loads_once(tiny_llm, models_file, tmp_path):
    llm = tiny_llm.rebuilt(models_file=str(models_file))
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "a-smol.jsonl", [line("s1", "smol"), line("s2", "smol", "What is the capital of Germany?")])
    write_batch(inbox / DATE, "b-tiny.jsonl", [line("t1", TINY_NAME), line("t2", TINY_NAME)])
    write_batch(inbox / DATE, "c-mixed.jsonl", [line("m1", TINY_NAME), line("m2", "smol"), line("m3", TINY_NAME),
                                                line("m4", "no-such-model")])
    instance = dg.DagsterInstance.ephemeral()
    result = materialize(llm, str(inbox), str(out), instance=instance)
    assert result.success
    answers = {}
    for name in ("a-smol", "b-tiny", "c-mixed"):
        for o in read_jsonl(f"{out}/{DATE}/{name}/output.jsonl"):
            answers[o["custom_id"]] = ChatCompletion.model_validate(o["response"]["body"])
    assert sorted(answers) == ["m1", "m2", "m3", "s1", "s2", "t1", "t2"]
    assert {k: v.model for k, v in answers.items()} == {
        "s1": "smol", "s2": "smol", "m2": "smol", "t1": TINY_NAME, "t2": TINY_NAME, "m1": TINY_NAME, "m3": TINY_NAME}
    # SmolLM2 (the real model) answers; the tiny random model does not know Paris.
    assert "Paris" in answers["s1"].choices[0].message.content and "Paris" in answers["m2"].choices[0].message.content
    assert "Berlin" in answers["s2"].choices[0].message.content
    assert not any("Paris" in answers[k].choices[0].message.content for k in ("t1", "m1"))
    [unknown] = read_jsonl(f"{out}/{DATE}/c-mixed/errors.jsonl")
    assert unknown["error"]["code"] == contract.MODEL_NOT_FOUND and "'smol'" in unknown["error"]["message"]

    logs = [entry.user_message for entry in instance.all_logs(result.run_id)]
    loads = [m for m in logs if m.startswith("loading generate model ")]
    # Files model by model (tiny: b, c; then smol: c's waiting line, a): one load each.
    assert [m.split()[3] for m in loads] == [TINY_NAME, "smol"], loads


def test_models_file_errors_name_the_file_and_the_entry(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("smol:\n  path: /x\n  batch_size: 0\n")
    with pytest.raises(ConfigError, match=r"MODELS_FILE=.*bad.yaml: model 'smol': BATCH_SIZE=0 is out of range"):
        EngineSettings(models_file=str(bad)).model_registry()
    bad.write_text("smol:\n  path: /x\n  batchsize: 8\n")
    with pytest.raises(ConfigError, match="model 'smol' has unknown setting\\(s\\) batchsize"):
        EngineSettings(models_file=str(bad)).model_registry()
    bad.write_text("smol: {preset: cpu}\n")
    with pytest.raises(ConfigError, match="model 'smol' needs a path"):
        EngineSettings(models_file=str(bad)).model_registry()
    bad.write_text("smol: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        EngineSettings(models_file=str(bad)).model_registry()
    good = tmp_path / "good.yaml"
    good.write_text("models:\n  smol: /models/smol\n  big:\n    path: /models/big\n    preset: h100-8b\n    batch_size: 64\n")
    registry = EngineSettings(models_file=str(good), batch_size=32, reasoning_parser="deepseek_r1").model_registry()
    assert list(registry) == ["smol", "big"]
    assert registry["smol"].model_path == "/models/smol" and registry["smol"].batch_size == 32  # inherited
    assert registry["smol"].reasoning_parser == ""  # the default model's parser is not carried over
    assert registry["big"].batch_size == 64 and registry["big"].dtype == "bfloat16"  # preset, then its own field

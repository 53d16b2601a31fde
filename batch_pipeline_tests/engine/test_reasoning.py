"""Reasoning models (REASONING_PARSER) with a real engine and vLLM's own `deepseek_r1` parser.

No reasoning model can be downloaded here, so the bundled SmolLM2 is given `<think>`/`</think>`
tokens (thinking_model.py) and made to think by a structured-output regex (vLLM's
`structured_outputs` body extension): `<think>[a-z ]{1,40}</think>[A-Z][a-z]{1,20}`. With a
`logit_bias` on the two tag tokens the model writes them as the single tokens a reasoning model
emits (vLLM's parser counts the thinking tokens between them); without it, it spells them in
several tokens (the text still splits, and the thinking is counted with the tokenizer).
"""

from __future__ import annotations

import json
import re

import pytest
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.io import storage
from batch_pipeline.engine.reasoning import ReasoningConfigError
from batch_pipeline.config.settings import ConfigError
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support.thinking_llm import REGEX, TAGS, THINKING

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def line(custom_id: str, **body) -> str:
    payload = {"model": THINKING, "messages": QUESTION, "temperature": 0, "max_tokens": 40, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": contract.CHAT_URL, "body": payload})


def test_thinking_is_split_from_the_answer_and_counted(thinking_llm, thinking_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_model_dir)
    inbox, out = tmp_path / "in", tmp_path / "out"
    think = {"structured_outputs": {"regex": REGEX}}
    write_batch(inbox / DATE, "think.jsonl", [
        line("tags", logit_bias=TAGS, **think),  # the tags as single tokens, as a reasoning model writes them
        line("spelled", **think),  # the tags spelled in several tokens
        line("cut", max_tokens=2, logit_bias=TAGS, **think),  # the budget ends inside the thinking
        line("plain", max_tokens=8),  # no thinking at all
        line("json", max_tokens=12, response_format={"type": "json_object"}),  # constrained, no think tags
        line("effort", reasoning_effort="high"),  # ChatML does not take reasoning_effort
        line("bad-effort", reasoning_effort="extreme"),
    ])
    assert materialize(thinking_llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/think"
    outputs = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["cut", "json", "plain", "spelled", "tags"] and sorted(errors) == ["bad-effort", "effort"]

    tags = ChatCompletion.model_validate(outputs["tags"])
    message = tags.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{1,40}", reasoning) and message.model_extra["reasoning"] == reasoning
    assert re.fullmatch(r"[A-Z][a-z]{1,20}", message.content), message.content  # no tag left in the answer
    counted = tags.usage.completion_tokens_details.reasoning_tokens
    # vLLM's parser counts the tokens between the two tag tokens: the thinking's own tokens.
    assert counted == len(tokenizer.encode(reasoning, add_special_tokens=False)) >= 1
    assert counted + 2 < tags.usage.completion_tokens  # the tags and the answer are not thinking

    spelled = ChatCompletion.model_validate(outputs["spelled"])
    message = spelled.choices[0].message
    assert "<" not in message.content and re.fullmatch(r"[a-z ]{1,40}", message.model_extra["reasoning_content"])
    assert spelled.usage.completion_tokens_details.reasoning_tokens == len(
        tokenizer.encode(message.model_extra["reasoning_content"], add_special_tokens=False))

    cut = ChatCompletion.model_validate(outputs["cut"])
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == ""
    assert cut.choices[0].message.model_extra["reasoning_content"]  # what was thought before the cut
    assert cut.usage.completion_tokens_details.reasoning_tokens == 1  # <think> and one token of thought

    plain = ChatCompletion.model_validate(outputs["plain"])
    # No end tag: the parser takes the whole text as thinking (deepseek_r1 assumes the model
    # opened it in the prompt). That is vLLM's parser's rule for models that think first.
    assert plain.choices[0].message.model_extra["reasoning_content"]

    json_answer = ChatCompletion.model_validate(outputs["json"]).choices[0].message
    assert json_answer.content.lstrip().startswith("{") and json_answer.model_extra["reasoning_content"] is None

    assert "reasoning_effort" in errors["effort"]["error"]["message"]
    assert errors["effort"]["error"]["code"] == contract.INVALID_REQUEST
    assert "reasoning_effort" in errors["bad-effort"]["error"]["message"]

    import pandas as pd

    table = pd.read_parquet(f"{folder}/results.parquet").set_index("custom_id")
    assert table.loc["tags", "reasoning"] == tags.choices[0].message.model_extra["reasoning_content"]
    assert table.loc["tags", "content"] == tags.choices[0].message.content
    assert pd.isna(table.loc["json", "reasoning"]) and pd.isna(table.loc["effort", "reasoning"])

    batch = json.loads(storage.read_text(f"{folder}/batch.json"))
    bodies = [ChatCompletion.model_validate(b) for b in outputs.values()]
    assert batch["usage"]["output_tokens_details"]["reasoning_tokens"] == sum(
        b.usage.completion_tokens_details.reasoning_tokens for b in bodies) > 0
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(
        b.usage.prompt_tokens_details.cached_tokens for b in bodies)


def test_logit_bias_changes_the_answer(thinking_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "bias.jsonl", [line("free", max_tokens=6)])
    assert materialize(thinking_llm.rebuilt(reasoning_parser=""), str(inbox), str(out)).success
    [free] = read_jsonl(f"{out}/{DATE}/bias/output.jsonl")
    text = free["response"]["body"]["choices"][0]["message"]["content"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_llm.model_path)
    first = tokenizer.encode(text, add_special_tokens=False)[0]
    write_batch(inbox / "2026-11-28", "bias.jsonl", [line("banned", max_tokens=6, logit_bias={str(first): -100})])
    assert materialize(thinking_llm.rebuilt(reasoning_parser=""), str(inbox), str(out), partition="2026-11-28").success
    [banned] = read_jsonl(f"{out}/2026-11-28/bias/output.jsonl")
    other = banned["response"]["body"]["choices"][0]["message"]["content"]
    # The greedy answer's first token, banned: the answer starts otherwise.
    assert other and tokenizer.encode(other, add_special_tokens=False)[0] != first, (text, other)


def test_a_parser_that_does_not_fit_is_a_clear_config_error(tiny_llm, thinking_llm):
    with pytest.raises(ConfigError, match="REASONING_PARSER='no_such_parser' is not one of vLLM's reasoning parsers"):
        with thinking_llm.rebuilt(reasoning_parser="no_such_parser").open(log=lambda _m: None) as engines:
            _ = engines.generation
    # The tiny model's tokenizer has no <think>: deepseek_r1 cannot find its tags.
    with pytest.raises(ReasoningConfigError, match="REASONING_PARSER=deepseek_r1 does not fit the model"):
        with tiny_llm.rebuilt(reasoning_parser="deepseek_r1").open(log=lambda _m: None) as engines:
            _ = engines.generation

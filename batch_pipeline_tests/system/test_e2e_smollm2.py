"""End to end with the real bundled SmolLM2-135M-Instruct: real answers to factual questions.

A hostile mixed file of the kind users send (a BOM, a CRLF line, a blank line, no final newline;
valid lines with system prompts, text parts, n=2, json_schema, logprobs, seed and stop, Chinese, a
lower-case "post"; and a dozen kinds of bad line) goes through the same assets the CLI runs, with
MAX_MODEL_LEN=2048. Every line must be answered once, bodies must parse with the openai SDK types,
and the model must get the capitals right. The S3 path and the daemon are covered elsewhere.
"""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batch_pipeline.defs.jobs import run_batch
from batch_pipeline.defs.resources import BatchSelection, StorageResource
from batch_pipeline_tests.support.cli_runs import read_results

pytestmark = pytest.mark.smollm2

MODEL = "SmolLM2-135M-Instruct"


def line(custom_id, body=None, method="POST", url="/v1/chat/completions", **fields):
    obj = {"custom_id": custom_id, "method": method, "url": url, "body": body, **fields}
    if custom_id is None:
        del obj["custom_id"]
    return json.dumps(obj, ensure_ascii=False)


def chat(*messages, **extra):
    return {"model": MODEL, "messages": list(messages), "max_tokens": 24, "temperature": 0, **extra}


def user(text):
    return {"role": "user", "content": text}


VALID = {
    "france": chat(user("What is the capital of France?")),
    "germany": chat({"role": "system", "content": "You are a helpful geography assistant."}, user("What is the capital of Germany?")),
    "japan": chat({"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of Japan?"}]}),
    "two-names": chat(user("Suggest a name for a dog."), n=2, temperature=0.9, seed=11),
    "person-json": chat(
        user("Describe a fictional person as JSON with a name and an age."),
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": {
                "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False}},
        },
    ),
    "logprobs": chat(user("Say yes."), max_tokens=3, logprobs=True, top_logprobs=2),
    "seeded-stop": chat(user("Count from one to ten in words."), temperature=0.7, seed=5, stop=["five"], max_tokens=40),
    "chinese": chat(user("中国的首都是哪里？"), max_tokens=16),
}


def build_file(path):
    rows = [line(cid, body) for cid, body in VALID.items()]
    rows.append(line("guide-example", chat(user("What is 2 + 2?")), method="post"))
    rows.append(line("completion", {"model": MODEL, "prompt": "The capital of Italy is", "max_tokens": 5, "temperature": 0},
                     url="/v1/completions"))
    bad = {
        "truncated": '{"custom_id": "truncated", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "' + MODEL,
        "no-id": line(None, chat(user("hi"))),
        "dup": line("france", chat(user("again"))),
        "bad-url": line("bad-url", chat(user("hi")), url="/v1/images/generations"),
        "get": line("get", chat(user("hi")), method="GET"),
        "empty-messages": line("empty-messages", {"model": MODEL, "messages": []}),
        "unknown-model": line("unknown-model", {**chat(user("hi")), "model": "gpt-4o-mini"}),
        "hot": line("hot", chat(user("hi"), temperature=2.5)),
        "array": json.dumps([{"custom_id": "array"}]),
        "too-long": line("too-long", chat(user("lorem ipsum dolor " * 1200))),
        "wizard": line("wizard", chat({"role": "wizard", "content": "hi"})),
    }
    text = "\ufeff" + rows[0] + "\r\n" + "\n".join(rows[1:5]) + "\n\n" + "\n".join(rows[5:] + list(bad.values()))
    path.write_bytes(text.encode("utf-8"))  # no final newline
    return bad


EXPECTED_CODES = {
    "truncated": "invalid_json", "no-id": "invalid_request", "dup": "duplicate_custom_id", "bad-url": "unsupported_url",
    "get": "invalid_method", "empty-messages": "invalid_request", "unknown-model": "model_not_found",
    "hot": "invalid_request", "array": "invalid_request", "too-long": "context_length_exceeded", "wizard": "invalid_request",
}


@pytest.fixture(scope="module")
def results(smollm2_llm_module, tmp_path_factory):
    folder = tmp_path_factory.mktemp("e2e")
    build_file(folder / "mixed.jsonl")
    out = folder / "out"
    result = run_batch(
        str(folder / "mixed.jsonl"), str(out), "2026-11-30",
        resources={"batch": BatchSelection(), "llm": smollm2_llm_module, "storage": StorageResource(input_path=str(folder), output_path=str(out))},
    )
    assert result.success
    return read_results(out)


@pytest.fixture(scope="module")
def smollm2_llm_module(bundled_model_dir):
    from batch_pipeline_tests.support import SessionLLM

    mp = pytest.MonkeyPatch()
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "SHARD_SIZE", "CHECKPOINT_ANSWERS", "CHECKPOINT_SECONDS"):
        mp.delenv(var, raising=False)
    mp.setenv("KV_CACHE_MEMORY_BYTES", str(512 * 2**20))
    yield SessionLLM(max_model_len=2048)
    mp.undo()


def answers(outputs):
    return {o["custom_id"]: o["response"]["body"] for o in outputs}


def text(body, i=0):
    return body["choices"][i]["message"]["content"]


def test_every_line_answered_exactly_once(results):
    outputs, errors, batch = results
    valid_ids = sorted([*VALID, "guide-example", "completion"])
    assert sorted(o["custom_id"] for o in outputs) == valid_ids
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": len(valid_ids) + len(EXPECTED_CODES), "completed": len(valid_ids),
                                       "failed": len(EXPECTED_CODES)}
    assert len({o["id"] for o in outputs + errors}) == len(outputs) + len(errors)


def test_bad_lines_have_codes_and_line_numbers(results):
    _, errors, _ = results
    assert len(errors) == len(EXPECTED_CODES)
    by_code = sorted(e["error"]["code"] for e in errors)
    assert by_code == sorted(EXPECTED_CODES.values())
    for e in errors:
        assert e["response"] is None and isinstance(e["error"]["line"], int)
        assert e["error"]["message"].startswith(f"line {e['error']['line']}: ")
    no_id = [e for e in errors if e["custom_id"] is None]
    assert [e["error"]["code"] for e in no_id] == ["invalid_request", "invalid_request"]  # missing id, JSON array
    truncated = next(e for e in errors if e["error"]["code"] == "invalid_json")
    assert truncated["custom_id"] == "truncated"  # salvaged from the broken line


def test_bodies_parse_with_the_openai_sdk(results):
    outputs, _, _ = results
    for o in outputs:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        body = o["response"]["body"]
        parsed = Completion.model_validate(body) if body["object"] == "text_completion" else ChatCompletion.model_validate(body)
        assert parsed.usage.completion_tokens > 0


def test_factual_answers_are_right(results):
    got = answers(results[0])
    assert "Paris" in text(got["france"])
    assert "Berlin" in text(got["germany"])
    assert "Tokyo" in text(got["japan"])
    assert "4" in text(got["guide-example"]) or "four" in text(got["guide-example"]).lower()
    assert "Rome" in got["completion"]["choices"][0]["text"]


def test_sampling_fields_take_effect(results):
    got = answers(results[0])
    assert len(got["two-names"]["choices"]) == 2
    person = json.loads(text(got["person-json"]))
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    content = got["logprobs"]["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 for t in content)
    assert "five" not in text(got["seeded-stop"]).lower()
    assert text(got["chinese"]).strip()

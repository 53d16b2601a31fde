"""Tool (function) calling on chat lines (engine/tool_calls.py) with a real engine and SmolLM2.

A named tool_choice and `required` are constrained by structured outputs, so even a 135M model's
calls parse and match the schema. `auto` reads the calls with vLLM's own tool parser
(TOOL_CALL_PARSER): SmolLM2 knows no tool format, so a structured-output regex (vLLM's
`structured_outputs` body extension) makes it write the hermes format, `<tool_call>{...}</tool_call>`;
the hermes parser works on the text, so the tags need not be single tokens. Every body is loaded
with the openai SDK's ChatCompletion.
"""

from __future__ import annotations

import json
import re

import pytest
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.engine.local import Engines
from batch_pipeline.engine.tool_calls import ToolParserConfigError, required_schema
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch

try:
    import jsonschema
except ImportError:  # pragma: no cover - a transitive dependency of vLLM here
    jsonschema = None

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
pytestmark = pytest.mark.smollm2  # real answers from the bundled model

HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def engines(smollm2_llm):
    with smollm2_llm.open(log=lambda _m: None) as e:
        yield e


def req(line: int, **body) -> contract.BatchRequest:
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, **body}
    return contract.BatchRequest(line=line, custom_id=f"id-{line}", url=contract.CHAT_URL, body=body)


def run(engines: Engines, *requests: contract.BatchRequest) -> dict[int, dict]:
    answers = list(engines.stream("batch_tools", list(requests), created=1_700_000_000))
    assert sorted(a.line for a in answers) == sorted(r.line for r in requests)
    return {a.line: a.record for a in answers}


def completion(record: dict) -> ChatCompletion:
    assert record["error"] is None and record["response"]["status_code"] == 200, record
    return ChatCompletion.model_validate(record["response"]["body"])


def check_arguments(name: str, arguments: str) -> dict:
    """The arguments parse as JSON and match the function's schema."""
    value = json.loads(arguments)
    schema = SCHEMAS[name]
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    else:
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        assert all(isinstance(value[k], str) for k in value)
    return value


def test_named_choice_calls_that_function_with_arguments_that_match_its_schema(engines):
    named = {"type": "function", "function": {"name": "get_weather"}}
    answers = run(engines, req(1, tools=[WEATHER, TIME], tool_choice=named),
                  req(2, tools=[WEATHER, TIME], tool_choice=named),  # same line again: same ids
                  req(3, tools=[WEATHER], tool_choice=named, max_tokens=3))  # cut inside the JSON
    first = completion(answers[1])
    choice = first.choices[0]
    # OpenAI answers a call forced by name with finish_reason "stop".
    assert choice.finish_reason == "stop" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    check_arguments("get_weather", call.function.arguments)
    again = completion(answers[2]).choices[0].message.tool_calls[0]
    assert again.function == call.function and again.id != call.id  # the id is per line
    rerun = completion(run(engines, req(1, tools=[WEATHER, TIME], tool_choice=named))[1])
    assert rerun.choices[0].message.tool_calls[0].id == call.id  # and deterministic

    cut = completion(answers[3]).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content and cut.message.content.lstrip().startswith("{")  # the raw, unfinished JSON


def test_required_choice_calls_declared_tools_and_parallel_false_gives_one_call(engines):
    answers = run(engines,
                  req(1, tools=[WEATHER, TIME], tool_choice="required"),
                  req(2, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
                  req(3, tools=[TIME, WEATHER], tool_choice="required", parallel_tool_calls=False, n=2,
                      temperature=1.0, seed=7))
    for line in (1, 2, 3):
        body = completion(answers[line])
        for choice in body.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            calls = choice.message.tool_calls
            assert calls and len({c.id for c in calls}) == len(calls)
            for call in calls:
                assert call.function.name in SCHEMAS
                check_arguments(call.function.name, call.function.arguments)
            if line != 1:
                assert len(calls) == 1
    ids = [c.message.tool_calls[0].id for c in completion(answers[3]).choices]
    assert len(set(ids)) == 2  # one id per choice


def test_required_schema_is_vllms():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    for parallel in (None, False, True):
        ours = required_schema([WEATHER, TIME], parallel)
        theirs = get_json_schema_from_tools("required", [ChatCompletionToolsParam.model_validate(t) for t in (WEATHER, TIME)],
                                            parallel)
        assert ours == theirs


def test_history_with_tool_calls_and_results_is_rendered(engines, bundled_model_dir):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and 24 degrees celsius in Paris today."}
    answers = run(engines,
                  req(1, messages=[*history, result], tools=[WEATHER], tool_choice="none", max_tokens=10),
                  req(2, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=10),
                  req(3, messages=[*history, result], max_tokens=10))  # no tools
    with_result, without, no_tools = (completion(answers[n]) for n in (1, 2, 3))
    assert with_result.choices[0].message.tool_calls is None  # tool_choice none: an ordinary answer
    assert with_result.choices[0].message.content
    assert with_result.usage.prompt_tokens > without.usage.prompt_tokens
    # SmolLM2's ChatML template renders the tool result as a `tool` turn and ignores the tool list.
    assert with_result.usage.prompt_tokens == no_tools.usage.prompt_tokens
    # The count made before running is the engine's own (the prompt vLLM rendered).
    generation = engines.generation
    prepared = generation.prepare("batch_tools", req(1, messages=[*history, result], tools=[WEATHER], tool_choice="none"))
    assert prepared.prompt_lens == [with_result.usage.prompt_tokens]
    assert prepared.prompts[0][1]["tool_calls"] == [call] and prepared.prompts[0][2]["tool_call_id"] == "call_1"


def test_auto_without_a_tool_parser_is_a_per_line_error(engines):
    answers = run(engines, req(1, tools=[WEATHER]), req(2, tools=[WEATHER], tool_choice="auto"),
                  req(3, max_tokens=4), req(4, tools=[WEATHER], tool_choice="none", max_tokens=4))
    for line in (1, 2):
        error = answers[line]["error"]
        assert answers[line]["response"] is None and error["code"] == contract.INVALID_REQUEST
        assert error["message"].startswith(f"line {line}: body.tool_choice: 'auto'")
        assert "TOOL_CALL_PARSER" in error["message"]
    assert completion(answers[3]).choices[0].message.content
    assert completion(answers[4]).choices[0].message.tool_calls is None


def test_auto_with_the_hermes_parser_reads_the_calls(smollm2_llm):
    call_regex = re.escape(HERMES_CALL).replace("\\ ", " ")  # xgrammar takes a space as it is
    with smollm2_llm.rebuilt(tool_call_parser="hermes").open(log=lambda _m: None) as engines:
        answers = run(engines,
                      req(1, tools=[WEATHER], structured_outputs={"regex": call_regex}),
                      req(2, tools=[WEATHER], structured_outputs={"regex": r"Let me check\. " + call_regex}),
                      req(3, tools=[WEATHER], max_tokens=6),  # no call: an ordinary answer
                      req(4, tools=[WEATHER], structured_outputs={"regex": call_regex}, max_tokens=12))  # cut
    first = completion(answers[1]).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")

    prose = completion(answers[2]).choices[0]
    assert prose.finish_reason == "tool_calls" and prose.message.content == "Let me check. "
    assert prose.message.tool_calls[0].function.name == "get_weather"

    plain = completion(answers[3]).choices[0]
    assert plain.message.tool_calls is None and plain.message.content and "<tool_call>" not in plain.message.content

    cut = completion(answers[4]).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith("<tool_call>{") and cut.message.content in HERMES_CALL


def test_an_unknown_tool_parser_is_a_clear_config_error(smollm2_llm):
    with pytest.raises(ToolParserConfigError, match="TOOL_CALL_PARSER='no_such_parser' is not one of vLLM's tool parsers"):
        with smollm2_llm.rebuilt(tool_call_parser="no_such_parser").open(log=lambda _m: None) as engines:
            _ = engines.generation


def test_a_batch_with_tool_lines(smollm2_llm, tmp_path):
    """Through the pipeline: validation (the fast path and pydantic), output and error files, results.parquet."""
    import pandas as pd

    def chat(custom_id: str, **body) -> str:
        payload = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, **body}
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": contract.CHAT_URL, "body": payload})

    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "tools.jsonl", [
        chat("named", tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
        chat("required", tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
        chat("auto", tools=[WEATHER]),  # no TOOL_CALL_PARSER
        chat("undeclared", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
        chat("hosted", tools=[{"type": "web_search"}]),
        chat("plain", max_tokens=5),
    ])
    assert materialize(smollm2_llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/tools"
    outputs = {o["custom_id"]: ChatCompletion.model_validate(o["response"]["body"])
               for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["named", "plain", "required"] and sorted(errors) == ["auto", "hosted", "undeclared"]
    [named] = outputs["named"].choices[0].message.tool_calls
    assert named.function.name == "get_time" and check_arguments("get_time", named.function.arguments)
    [required] = outputs["required"].choices[0].message.tool_calls
    assert outputs["required"].choices[0].finish_reason == "tool_calls" and required.function.name in SCHEMAS
    assert all(e["code"] == contract.INVALID_REQUEST for e in errors.values())
    assert "body.tool_choice" in errors["auto"]["message"] and "TOOL_CALL_PARSER" in errors["auto"]["message"]
    assert "body.tool_choice: names the function 'get_time'" in errors["undeclared"]["message"]
    assert "body.tools[0].type" in errors["hosted"]["message"]

    table = pd.read_parquet(f"{folder}/results.parquet").set_index("custom_id")
    assert json.loads(table.loc["named", "tool_calls"]) == [named.model_dump(exclude_none=True)]
    assert table.loc["named", "finish_reason"] == "stop" and pd.isna(table.loc["named", "content"])
    assert pd.isna(table.loc["plain", "tool_calls"]) and table.loc["plain", "content"]

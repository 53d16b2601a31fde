"""`/v1/responses` lines (OpenAI's Responses API in a batch file) against real vLLM on the CPU.

A Responses line runs as the chat it amounts to (instructions as a system message, then the input)
and is answered with an OpenAI `response` object, which the `openai` SDK's `Response` type must
load, with `output_text` the answer. Engine-level tests on the tiny random Llama (shapes, counts,
the same prompt as the equivalent chat line), SmolLM2 for real answers and JSON under a schema,
and the pipeline with the thinking SmolLM2 (thinking_model.py) for reasoning items. The refused
fields are also validation cases in test_validation.py.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from batch_pipeline import contract
from batch_pipeline.base import ids
from batch_pipeline.io import storage
from batch_pipeline.steps.validation import InvalidLine, LineValidator, ValidationSettings
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import TINY_NAME
from batch_pipeline_tests.support.thinking_llm import REGEX, TAGS, THINKING

BATCH = "batch_test"
QUESTION = "What is the capital of France?"


@pytest.fixture
def engines(tiny_llm):
    with tiny_llm.open(log=lambda _m: None) as e:
        yield e


def responses_req(line: int, model: str = TINY_NAME, **body) -> contract.BatchRequest:
    return contract.BatchRequest(line=line, custom_id=f"id-{line}", url=contract.RESPONSES_URL,
                                 body={"model": model, **body})


def chat_req(line: int, model: str = TINY_NAME, **body) -> contract.BatchRequest:
    return contract.BatchRequest(line=line, custom_id=f"id-{line}", url=contract.CHAT_URL, body={"model": model, **body})


def run(engines, *requests):
    answers = list(engines.stream(BATCH, list(requests), created=1_700_000_000))
    assert sorted(a.line for a in answers) == sorted(r.line for r in requests)  # exactly once
    return {a.line: a for a in answers}


def response_of(answer) -> Response:
    record = answer.record
    assert answer.kind == "output" and record["error"] is None and record["response"]["status_code"] == 200, record
    return Response.model_validate(record["response"]["body"])


def messages_of(response: Response) -> list:
    return [item for item in response.output if item.type == "message"]


def test_string_input_is_a_user_turn_and_the_response_loads_with_the_openai_type(engines):
    answers = run(engines,
                  responses_req(1, input="hello there", max_output_tokens=6, temperature=0),
                  chat_req(2, messages=[{"role": "user", "content": "hello there"}], max_tokens=6, temperature=0))
    response, answer = response_of(answers[1]), answers[1]
    chat = ChatCompletion.model_validate(answers[2].record["response"]["body"])
    assert response.object == "response" and response.model == TINY_NAME and response.created_at == 1_700_000_000
    assert response.id == ids.response_id(BATCH, 1) and response.id.startswith("resp_")
    assert answers[1].record["custom_id"] == "id-1" and answers[1].record["id"] == ids.request_line_id(BATCH, 1)
    [message] = messages_of(response)
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == message.content[0].text == chat.choices[0].message.content
    # The same conversation as the chat line: the same prompt, counted alike.
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 3
    assert 1 <= response.usage.output_tokens <= 6
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (answer.prompt_tokens, answer.completion_tokens) == (response.usage.input_tokens, response.usage.output_tokens)
    assert answer.cached_tokens == response.usage.input_tokens_details.cached_tokens
    assert answer.reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.temperature == 0 and response.tools == [] and response.text.format.type == "text"


def test_instructions_come_first_as_a_system_message_before_the_input_messages(engines):
    turns = [
        {"role": "user", "content": "first question"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "an answer", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "second"}, {"type": "input_text", "text": "part"}]},
    ]
    as_chat = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "second\npart"},
    ]
    answers = run(engines,
                  responses_req(1, instructions="Answer briefly.", input=turns, max_output_tokens=5, temperature=0),
                  chat_req(2, messages=as_chat, max_tokens=5, temperature=0),
                  responses_req(3, input=turns, max_output_tokens=5, temperature=0))
    response, without = response_of(answers[1]), response_of(answers[3])
    chat = ChatCompletion.model_validate(answers[2].record["response"]["body"])
    assert response.instructions == "Answer briefly."
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    # The instructions are in the prompt: more input tokens than the same turns without them.
    assert response.usage.input_tokens > without.usage.input_tokens
    assert without.instructions is None


def test_max_output_tokens_cut_makes_the_response_incomplete(engines):
    answers = run(engines, responses_req(1, input="hello", max_output_tokens=3, temperature=0, ignore_eos=True),
                  responses_req(2, input="hello", max_output_tokens=40, temperature=0, metadata={"k": "v"}, user="u-1"))
    cut, room = response_of(answers[1]), response_of(answers[2])
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.max_output_tokens == 3
    [message] = messages_of(cut)
    assert message.status == "incomplete" and cut.completed_at is None
    assert room.max_output_tokens == 40 and room.metadata == {"k": "v"} and room.user == "u-1"
    if room.usage.output_tokens < 40:  # the random model stopped on its own
        assert room.status == "completed" and room.incomplete_details is None and room.completed_at is not None


def test_reasoning_effort_is_refused_on_a_template_that_does_not_take_it(engines):
    answers = run(engines, responses_req(1, input="hi", reasoning={"effort": "low"}, max_output_tokens=2))
    record = answers[1].record
    assert answers[1].kind == "error" and record["error"]["code"] == contract.INVALID_REQUEST
    assert record["error"]["message"].startswith("line 1: reasoning.effort: the chat template of tiny-llama does not take it")


def test_smollm2_answers_paris_and_follows_a_json_schema(smollm2_llm):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}
    with smollm2_llm.open(log=lambda _m: None) as engines:
        name = engines.generation.served_model_name
        answers = run(engines,
                      responses_req(1, name, input=QUESTION, temperature=0, max_output_tokens=30),
                      responses_req(2, name, input=QUESTION, temperature=0, max_output_tokens=40, text={"format": fmt}),
                      responses_req(3, name, input=QUESTION, temperature=0, max_output_tokens=40,
                                    text={"format": {"type": "json_object"}}))
    plain, structured, json_object = (response_of(answers[i]) for i in (1, 2, 3))
    assert "Paris" in plain.output_text, plain.output_text
    assert structured.status == "completed", structured.output_text
    value = json.loads(structured.output_text)
    assert set(value) == {"capital"} and isinstance(value["capital"], str) and len(value["capital"]) <= 20
    assert structured.text.format.type == "json_schema" and structured.text.format.name == "capital"
    assert structured.text.format.schema_ == schema and structured.text.format.strict is True
    assert json_object.output_text.lstrip().startswith("{") and json_object.text.format.type == "json_object"


REFUSED = [
    # (field in the message, body fields, text the message must contain)
    ("body.previous_response_id", {"previous_response_id": "resp_123"}, "stored on a server"),
    ("body.conversation", {"conversation": "conv_123"}, "stored on a server"),
    ("body.prompt", {"prompt": {"id": "pmpt_1"}}, "stored on a server"),
    ("body.background", {"background": True}, "background"),
    ("body.stream", {"stream": True}, "streamed"),
    ("body.tools[0].type", {"tools": [{"type": "web_search"}]}, "cannot run in an offline batch"),
    ("body.tools[1].type", {"tools": [{"type": "function", "name": "f", "parameters": {}}, {"type": "file_search"}]},
     "'file_search' tools"),
    ("body.tool_choice", {"tool_choice": "required"}, "'required' needs tools"),
    ("body.tool_choice", {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "'g' is not one of the tools ('f')"),
    ("body.tool_choice", {"tool_choice": {"type": "file_search"}}, "only function tools"),
    ("body.input[0].content[0].image_url", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "does not take images (a text-only model)"),
    ("body.text.format", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema is required"),
]


@pytest.mark.parametrize("field,fields,needle", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_what_cannot_exist_offline_is_refused_naming_the_field(field, fields, needle):
    body = {"model": "m", "input": "hi", **fields}
    raw = json.dumps({"custom_id": "r", "method": "POST", "url": contract.RESPONSES_URL, "body": body}).encode()
    result = LineValidator(ValidationSettings("m")).validate(5, raw)
    assert isinstance(result, InvalidLine) and result.code == contract.INVALID_REQUEST, result
    assert result.message.startswith(f"line 5: {field}: ") and needle in result.message, result.message


def responses_line(custom_id: str, model: str, **body) -> str:
    payload = {"model": model, "input": QUESTION, "temperature": 0, "max_output_tokens": 40, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": contract.RESPONSES_URL, "body": payload})


def test_a_responses_batch_through_the_pipeline(tiny_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "resp.jsonl", [
        responses_line("a", TINY_NAME, max_output_tokens=4, ignore_eos=True),
        responses_line("b", TINY_NAME, instructions="Be brief.", max_output_tokens=3, ignore_eos=True),
        responses_line("stored", TINY_NAME, previous_response_id="resp_1"),
        responses_line("other-model", "gpt-4o"),
    ])
    assert materialize(tiny_llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/resp"
    outputs = {o["custom_id"]: Response.model_validate(o["response"]["body"]) for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["a", "b"] and sorted(errors) == ["other-model", "stored"]
    assert errors["stored"]["code"] == contract.INVALID_REQUEST and "body.previous_response_id" in errors["stored"]["message"]
    assert errors["other-model"]["code"] == contract.MODEL_NOT_FOUND
    assert all(r.status == "incomplete" for r in outputs.values())
    batch = json.loads(storage.read_text(f"{folder}/batch.json"))
    assert batch["endpoint"] == contract.RESPONSES_URL
    assert batch["usage"]["output_tokens"] == sum(r.usage.output_tokens for r in outputs.values()) == 7
    assert batch["usage"]["input_tokens"] == sum(r.usage.input_tokens for r in outputs.values())
    table = pd.read_parquet(f"{folder}/results.parquet").set_index("custom_id")
    assert table.loc["a", "content"] == outputs["a"].output_text
    assert table.loc["b", "finish_reason"] == "length" and table.loc["b", "completion_tokens"] == 3
    assert table.loc["b", "prompt_tokens"] == outputs["b"].usage.input_tokens


def test_thinking_is_a_reasoning_item_before_the_message(thinking_llm, thinking_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_model_dir)
    inbox, out = tmp_path / "in", tmp_path / "out"
    think = {"structured_outputs": {"regex": REGEX}, "logit_bias": TAGS}
    write_batch(inbox / DATE, "think.jsonl", [
        responses_line("think", THINKING, **think),
        responses_line("cut", THINKING, max_output_tokens=2, **think),  # the budget ends inside the thinking
        responses_line("json", THINKING, max_output_tokens=12, text={"format": {"type": "json_object"}}),
        responses_line("effort", THINKING, reasoning={"effort": "high"}),  # ChatML does not take it
    ])
    assert materialize(thinking_llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/think"
    outputs = {o["custom_id"]: Response.model_validate(o["response"]["body"]) for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["cut", "json", "think"] and sorted(errors) == ["effort"]
    assert errors["effort"]["error"]["code"] == contract.INVALID_REQUEST
    assert "reasoning.effort" in errors["effort"]["error"]["message"]

    think = outputs["think"]
    assert [item.type for item in think.output] == ["reasoning", "message"]
    reasoning, message = think.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    [part] = reasoning.content
    assert part.type == "reasoning_text" and re.fullmatch(r"[a-z ]{1,40}", part.text), part.text
    assert re.fullmatch(r"[A-Z][a-z]{1,20}", think.output_text), think.output_text  # no tag, no thinking in the answer
    assert message.content[0].text == think.output_text and think.status == "completed"
    counted = think.usage.output_tokens_details.reasoning_tokens
    assert counted == len(tokenizer.encode(part.text, add_special_tokens=False)) >= 1
    assert counted + 2 < think.usage.output_tokens

    cut = outputs["cut"]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in cut.output] == ["reasoning"] and cut.output_text == ""
    assert cut.output[0].status == "incomplete" and cut.output[0].content[0].text

    json_answer = outputs["json"]
    assert [item.type for item in json_answer.output] == ["message"]  # constrained, no think tags: all answer
    assert json_answer.output_text.lstrip().startswith("{")

    batch = json.loads(storage.read_text(f"{folder}/batch.json"))
    assert batch["usage"]["output_tokens_details"]["reasoning_tokens"] == sum(
        r.usage.output_tokens_details.reasoning_tokens for r in outputs.values()) > 0
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(
        r.usage.input_tokens_details.cached_tokens for r in outputs.values())


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"], "additionalProperties": False}}
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The local time in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}


def test_function_tools_give_function_call_items_and_calls_in_the_input_are_history(smollm2_llm):
    """Responses function tools run as the chat's: a named or required choice is constrained to the
    schema and comes back as function_call items; function_call / function_call_output items in the
    input are the conversation's history (an assistant turn with tool_calls, a tool turn)."""
    weather = "What is the weather in Paris?"
    history = [
        {"role": "user", "content": weather},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 degrees"},
    ]
    with smollm2_llm.open(log=lambda _m: None) as engines:
        name = engines.generation.served_model_name
        answers = run(
            engines,
            responses_req(1, name, input=weather, tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                          temperature=0, max_output_tokens=40),
            responses_req(2, name, input=weather, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                          parallel_tool_calls=False, temperature=0, max_output_tokens=60),
            responses_req(3, name, input=history, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_output_tokens=20),
            responses_req(4, name, input=history[:1], tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_output_tokens=20),
        )
    named, required, answered, unanswered = (response_of(answers[i]) for i in (1, 2, 3, 4))
    for response, names in ((named, {"get_weather"}), (required, {"get_weather", "get_time"})):
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name in names, response.output
        assert json.loads(calls[0].arguments).keys() == {"city"}
        assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_") and calls[0].status == "completed"
        assert not messages_of(response) and response.output_text == ""
        assert [t.name for t in response.tools] == sorted(names, key=["get_weather", "get_time"].index)
    assert required.parallel_tool_calls is False
    # The call and its output are in the prompt: more input tokens than the question alone, and an answer.
    assert answered.usage.input_tokens > unanswered.usage.input_tokens + 5
    assert answered.output_text and not [item for item in answered.output if item.type == "function_call"]

"""Validation of input lines against the batch contract (steps/validation.py, the models under contract/).

Pure unit tests: no model, no Dagster, no storage. Each rule of BATCH_CONTRACT.md has a case that
must be accepted or rejected with the right code, line number and field in the message.
"""

from __future__ import annotations

import hashlib
import io
import json
import tracemalloc

import pytest

from batch_pipeline import contract
from batch_pipeline.contract import fastpath
from batch_pipeline.steps.validation import (
    InvalidLine,
    LineValidator,
    ValidLine,
    ValidationSettings,
    validate_stream,
)

MODEL = "tiny-model"
SETTINGS = ValidationSettings(served_model_name=MODEL, embedding_model_name="embed-model")


def chat(**body):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}


def line(custom_id="r1", method="POST", url=contract.CHAT_URL, body=None, **extra):
    obj = {"custom_id": custom_id, "method": method, "url": url, "body": chat() if body is None else body, **extra}
    return json.dumps(obj, ensure_ascii=False).encode()


def responses_line(custom_id="r1", **body):
    """A /v1/responses line; a field given as None is left out."""
    fields = {"model": MODEL, "input": "hi", **body}
    return line(custom_id, url=contract.RESPONSES_URL, body={k: v for k, v in fields.items() if v is not None})


def check(raw: bytes, number: int = 7):
    return LineValidator(SETTINGS).validate(number, raw)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d", "strict": True,
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

VALID = [
    ("plain chat", line()),
    ("method in lower case", line(method="post")),
    ("system and developer prompts", line(body=chat(messages=[
        {"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}]))),
    ("text parts", line(body=chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))),
    ("assistant and tool turns", line(body=chat(messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t", "tool_call_id": "1"},
        {"role": "user", "content": "again"}]))),
    ("sampling fields", line(body=chat(max_tokens=5, temperature=2, top_p=0.5, n=2, stop=["x", "y"], seed=3,
                                       presence_penalty=-2, frequency_penalty=2, logprobs=True, top_logprobs=3))),
    ("max_completion_tokens", line(body=chat(max_completion_tokens=9))),
    ("json_object", line(body=chat(response_format={"type": "json_object"}))),
    ("json_schema", line(body=chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}))),
    ("fields that change nothing offline are ignored", line(body=chat(user="u-1", stream=False))),
    ("chinese text", line(body=chat(messages=[{"role": "user", "content": "北京是哪个国家的首都？"}]))),
    ("completions string", line(url=contract.COMPLETIONS_URL, body={"model": MODEL, "prompt": "Once", "echo": True, "logprobs": 2})),
    ("completions list", line(url=contract.COMPLETIONS_URL, body={"model": MODEL, "prompt": ["a", "b"]})),
    ("embeddings", line(url=contract.EMBEDDINGS_URL, body={"model": "embed-model", "input": ["a", "b"], "encoding_format": "base64"})),
    ("64-character custom_id", line(custom_id="x" * 64)),
    ("fields that change nothing offline", line(body=chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
                                                          prompt_cache_key="p", safety_identifier="s"))),
    ("vLLM's sampling extensions", line(body=chat(top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=False, min_tokens=1,
                                                  stop_token_ids=[2], include_stop_str_in_output=True, skip_special_tokens=True,
                                                  spaces_between_special_tokens=True, bad_words=["x"], allowed_token_ids=[1, 2]))),
    ("reasoning and bias fields", line(body=chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": True},
                                                 logit_bias={"8": -100, "9": 50.5}, structured_outputs={"regex": "[a-z]+"}))),
    ("tools, tool_choice auto", line(body=chat(tools=[TOOL, {"type": "function", "function": {"name": "g"}}], tool_choice="auto"))),
    ("tools without tool_choice", line(body=chat(tools=[TOOL], parallel_tool_calls=False))),
    ("tool_choice none and required", line(body=chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=True))),
    ("named tool_choice", line(body=chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))),
    ("tool_choice none without tools", line(body=chat(tool_choice="none"))),
    ("auto with structured_outputs", line(body=chat(tools=[TOOL], structured_outputs={"regex": "<tool_call>.*"}))),
    ("tool call history", line(body=chat(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[TOOL], tool_choice="none"))),
]


# Valid lines the C fast path leaves to the pydantic path (endpoints it has no schema for, and the
# fields whose value decides whether they are fine).
VALID_SLOW = [
    ("text modality", line(body=chat(modalities=["text"]))),
    ("score", line(url=contract.SCORE_URL, body={"model": "embed-model", "queries": "q", "documents": ["a", "b"]})),
    ("score, vLLM's older names", line(url=contract.SCORE_URL, body={"model": "embed-model", "text_1": ["q", "r"], "text_2": ["a", "b"]})),
    ("rerank", line(url=contract.RERANK_URL, body={"model": "embed-model", "query": "q", "documents": ["a"], "top_n": 1})),
]


@pytest.mark.parametrize("raw", [v[1] for v in VALID + VALID_SLOW], ids=[v[0] for v in VALID + VALID_SLOW])
def test_valid_lines_pass(raw):
    result = check(raw)
    assert isinstance(result, ValidLine), result
    assert result.line == 7 and result.raw == raw
    assert result.body == json.loads(raw)["body"]
    assert json.loads(result.record()) == {"line": 7, "request": json.loads(raw)}


# /v1/responses lines: valid, though the msgspec fast path does not know the url (pydantic decides).
RESPONSES_VALID = [
    ("string input", responses_line()),
    ("message list with instructions", responses_line(instructions="be brief", input=[
        {"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": []}]},
        {"role": "user", "content": "again"}])),
    ("sampling and limits", responses_line(max_output_tokens=9, temperature=0, top_p=0.5, seed=3, top_k=5)),
    ("text formats", responses_line(text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"},
                                                     "strict": True}})),
    ("json_object", responses_line(text={"format": {"type": "json_object"}, "verbosity": "low"})),
    ("reasoning effort", responses_line(reasoning={"effort": "low", "summary": "auto"})),
    ("accepted and ignored", responses_line(metadata={"k": "v"}, store=False, user="u-1", service_tier="auto",
                                            include=[], truncation="disabled", parallel_tool_calls=False)),
    ("false switches and no tools", responses_line(stream=False, background=False, tools=[], tool_choice="none")),
]


@pytest.mark.parametrize("raw", [v[1] for v in RESPONSES_VALID], ids=[v[0] for v in RESPONSES_VALID])
def test_valid_responses_lines_pass(raw):
    result = check(raw)
    assert isinstance(result, ValidLine), result
    assert result.url == contract.RESPONSES_URL and result.model == MODEL and result.raw == raw
    # The chat it runs as: instructions first, then the input's turns in order.
    chat = contract.ResponsesBody.model_validate(result.body).as_chat()
    body = result.body
    expected = ([body["instructions"]] if "instructions" in body else []) + (
        [body["input"]] if isinstance(body["input"], str) else [m["content"] if isinstance(m["content"], str)
                                                                  else m["content"][0]["text"] for m in body["input"]])
    assert [m.text() for m in chat.messages] == expected
    assert chat.max_completion_tokens == body.get("max_output_tokens")


def test_a_responses_line_maps_to_the_chat_fields_it_runs_as():
    body = contract.ResponsesBody.model_validate({
        "model": MODEL, "input": "q", "max_output_tokens": 7, "temperature": 0.3, "top_p": 0.9, "seed": 5,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "high"}, "top_k": 4, "logit_bias": {"8": -100}})
    chat = body.as_chat()
    assert (chat.max_completion_tokens, chat.token_limit(), chat.temperature, chat.top_p, chat.seed) == (7, 7, 0.3, 0.9, 5)
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.response_format.json_schema.name == "p" and chat.reasoning_effort == "high"
    assert chat.model_extra["top_k"] == 4 and chat.logit_bias == {8: -100}
    assert [(m.role, m.text()) for m in chat.messages] == [("user", "q")]


INVALID = [
    # (id, raw line, code, text the message must contain)
    ("truncated json", b'{"custom_id": "t1", "method": "POST", "url": "/v1/chat', contract.INVALID_JSON, "not valid JSON"),
    ("not utf-8", b'{"custom_id": "u1", "x": "\xff\xfe"}', contract.INVALID_JSON, "UTF-8"),
    ("NaN", line(body=chat(temperature=float("nan"))), contract.INVALID_JSON, "NaN"),
    ("Infinity", b'{"custom_id": "i", "method": "POST", "url": "/v1/chat/completions", "body": {"x": Infinity}}', contract.INVALID_JSON, "Infinity"),
    ("deeply nested", b'{"custom_id": "d", "a": ' + b"[" * 100000 + b"]" * 100000 + b"}", contract.INVALID_JSON, "nested"),
    ("json array", b'[{"custom_id": "a"}]', contract.INVALID_REQUEST, "expected a JSON object, got an array"),
    ("missing custom_id", json.dumps({"method": "POST", "url": contract.CHAT_URL, "body": chat()}).encode(), contract.INVALID_REQUEST, "custom_id"),
    ("numeric custom_id", line(custom_id=5), contract.INVALID_REQUEST, "custom_id"),
    ("empty custom_id", line(custom_id=""), contract.INVALID_REQUEST, "custom_id"),
    ("custom_id over 64", line(custom_id="x" * 65), contract.INVALID_REQUEST, "custom_id: 65 characters"),
    ("GET", line(method="GET"), contract.INVALID_METHOD, "method"),
    ("missing method", json.dumps({"custom_id": "m", "url": contract.CHAT_URL, "body": chat()}).encode(), contract.INVALID_METHOD, "method"),
    ("unsupported url", line(url="/v1/images/generations"), contract.UNSUPPORTED_URL, "/v1/chat/completions"),
    ("missing body", json.dumps({"custom_id": "b", "method": "POST", "url": contract.CHAT_URL}).encode(), contract.INVALID_REQUEST, "body"),
    ("body not object", line(body=[1]), contract.INVALID_REQUEST, "body: must be a JSON object"),
    ("empty messages", line(body=chat(messages=[])), contract.INVALID_REQUEST, "body.messages"),
    ("missing messages", line(body={"model": MODEL}), contract.INVALID_REQUEST, "body.messages"),
    ("unknown role", line(body=chat(messages=[{"role": "wizard", "content": "x"}])), contract.INVALID_REQUEST, "body.messages[0].role"),
    ("content missing", line(body=chat(messages=[{"role": "user"}])), contract.INVALID_REQUEST, "body.messages[0]"),
    ("image part", line(body=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),
     contract.INVALID_REQUEST, "body.messages[0].content[0].image_url: 'tiny-model' does not take images (a text-only model)"),
    ("temperature too high", line(body=chat(temperature=3.5)), contract.INVALID_REQUEST, "body.temperature"),
    ("temperature negative", line(body=chat(temperature=-0.1)), contract.INVALID_REQUEST, "body.temperature"),
    ("top_p zero", line(body=chat(top_p=0)), contract.INVALID_REQUEST, "body.top_p"),
    ("n zero", line(body=chat(n=0)), contract.INVALID_REQUEST, "body.n"),
    ("max_tokens zero", line(body=chat(max_tokens=0)), contract.INVALID_REQUEST, "body.max_tokens"),
    ("max_tokens string", line(body=chat(max_tokens="ten")), contract.INVALID_REQUEST, "body.max_tokens"),
    ("five stops", line(body=chat(stop=["a", "b", "c", "d", "e"])), contract.INVALID_REQUEST, "body.stop"),
    ("penalty out of range", line(body=chat(presence_penalty=2.5)), contract.INVALID_REQUEST, "body.presence_penalty"),
    ("top_logprobs without logprobs", line(body=chat(top_logprobs=2)), contract.INVALID_REQUEST, "top_logprobs requires logprobs"),
    ("top_logprobs over 20", line(body=chat(logprobs=True, top_logprobs=21)), contract.INVALID_REQUEST, "body.top_logprobs"),
    ("score without documents", line(url=contract.SCORE_URL, body={"model": "embed-model", "queries": "q"}),
     contract.INVALID_REQUEST, "body.documents: required with queries"),
    ("score with nothing to score", line(url=contract.SCORE_URL, body={"model": "embed-model"}),
     contract.INVALID_REQUEST, "body: queries and documents are required"),
    ("rerank with a query list", line(url=contract.RERANK_URL, body={"model": "embed-model", "query": ["q"], "documents": ["a"]}),
     contract.INVALID_REQUEST, "body.query: one string"),
    ("rerank with a negative top_n", line(url=contract.RERANK_URL, body={"model": "embed-model", "query": "q", "documents": ["a"], "top_n": -1}),
     contract.INVALID_REQUEST, "body.top_n"),
    ("score on the generation model", line(url=contract.SCORE_URL, body={"model": MODEL, "queries": "q", "documents": ["a"]}),
     contract.MODEL_NOT_FOUND, "/v1/score serves 'embed-model'"),
    ("completions with tools", line(url=contract.COMPLETIONS_URL, body={"model": MODEL, "prompt": "x", "tools": [
        {"type": "function", "function": {"name": "f"}}]}), contract.INVALID_REQUEST,
     "body.tools: tools are called on /v1/chat/completions lines only"),
    ("embeddings with tool_choice", line(url=contract.EMBEDDINGS_URL, body={"model": "embed-model", "input": "x",
                                                                            "tool_choice": "none"}),
     contract.INVALID_REQUEST, "body.tool_choice: tools are called on /v1/chat/completions lines only"),
    ("audio output", line(body=chat(audio={"voice": "alloy", "format": "wav"})), contract.INVALID_REQUEST,
     "body.audio: audio output cannot be produced"),
    ("audio modality", line(body=chat(modalities=["text", "audio"])), contract.INVALID_REQUEST, "body.modalities: only"),
    ("predicted output", line(body=chat(prediction={"type": "content", "content": "x"})), contract.INVALID_REQUEST,
     "body.prediction"),
    ("web search", line(body=chat(web_search_options={})), contract.INVALID_REQUEST, "body.web_search_options: web search"),
    ("legacy functions", line(body=chat(functions=[{"name": "f"}])), contract.INVALID_REQUEST, "body.functions"),
    ("streamed", line(body=chat(stream=True)), contract.INVALID_REQUEST, "body.stream: a batch line cannot be streamed"),
    ("old guided_json", line(body=chat(guided_json={})), contract.INVALID_REQUEST, "body.guided_json: vLLM's old guided_"),
    ("a misspelt field", line(body=chat(temprature=0.5)), contract.INVALID_REQUEST,
     "body.temprature: not a field of /v1/chat/completions this pipeline knows"),
    ("completions with an unknown field", line(url=contract.COMPLETIONS_URL, body={"model": MODEL, "prompt": "x", "suffix": "y"}),
     contract.INVALID_REQUEST, "body.suffix: not a field of /v1/completions"),
    ("embeddings with an unknown field", line(url=contract.EMBEDDINGS_URL, body={"model": "embed-model", "input": "x", "normalize": True}),
     contract.INVALID_REQUEST, "body.normalize: not a field of /v1/embeddings"),
    ("logit_bias over 100", line(body=chat(logit_bias={"8": 101})), contract.INVALID_REQUEST, "body.logit_bias.8"),
    ("logit_bias key not a token id", line(body=chat(logit_bias={"the": 5})), contract.INVALID_REQUEST, "body.logit_bias"),
    ("unknown reasoning_effort", line(body=chat(reasoning_effort="max")), contract.INVALID_REQUEST, "body.reasoning_effort"),
    ("structured_outputs not an object", line(body=chat(structured_outputs="a|b")), contract.INVALID_REQUEST,
     "body.structured_outputs"),
    ("bad response_format", line(body=chat(response_format={"type": "xml"})), contract.INVALID_REQUEST, "body.response_format"),
    ("json_schema without schema", line(body=chat(response_format={"type": "json_schema"})), contract.INVALID_REQUEST, "json_schema"),
    ("missing model", line(body={"messages": [{"role": "user", "content": "x"}]}), contract.INVALID_REQUEST, "body.model"),
    ("unknown model", line(body=chat(model="gpt-4o")), contract.MODEL_NOT_FOUND, "'gpt-4o'"),
    ("embedding model on chat", line(body=chat(model="embed-model")), contract.MODEL_NOT_FOUND, "embed-model"),
    ("completions without prompt", line(url=contract.COMPLETIONS_URL, body={"model": MODEL}), contract.INVALID_REQUEST, "body.prompt"),
    ("completions logprobs over 5", line(url=contract.COMPLETIONS_URL, body={"model": MODEL, "prompt": "x", "logprobs": 6}),
     contract.INVALID_REQUEST, "body.logprobs"),
    ("embeddings bad encoding", line(url=contract.EMBEDDINGS_URL, body={"model": "embed-model", "input": "x", "encoding_format": "hex"}),
     contract.INVALID_REQUEST, "body.encoding_format"),
    ("embeddings wrong model", line(url=contract.EMBEDDINGS_URL, body={"model": MODEL, "input": "x"}), contract.MODEL_NOT_FOUND, "embed-model"),
    # Tool calling on chat lines.
    ("tool of another type", line(body=chat(tools=[TOOL, {"type": "web_search"}])), contract.INVALID_REQUEST,
     "body.tools[1].type: 'web_search' tools are not supported"),
    ("tool without function", line(body=chat(tools=[{"type": "function"}])), contract.INVALID_REQUEST, "body.tools[0].function"),
    ("tool function without name", line(body=chat(tools=[{"type": "function", "function": {"parameters": {}}}])),
     contract.INVALID_REQUEST, "body.tools[0].function.name"),
    ("tool function name with spaces", line(body=chat(tools=[{"type": "function", "function": {"name": "get weather"}}])),
     contract.INVALID_REQUEST, "body.tools[0].function.name"),
    ("tool parameters not an object", line(body=chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])),
     contract.INVALID_REQUEST, "body.tools[0].function.parameters"),
    ("tools not a list", line(body=chat(tools=TOOL)), contract.INVALID_REQUEST, "body.tools"),
    ("unknown tool_choice", line(body=chat(tools=[TOOL], tool_choice="any")), contract.INVALID_REQUEST, "body.tool_choice"),
    ("named tool_choice not declared", line(body=chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})),
     contract.INVALID_REQUEST, "body.tool_choice: names the function 'f', which is not among body.tools"),
    ("named tool_choice without name", line(body=chat(tools=[TOOL], tool_choice={"type": "function", "function": {}})),
     contract.INVALID_REQUEST, "body.tool_choice"),
    ("required without tools", line(body=chat(tool_choice="required")), contract.INVALID_REQUEST,
     "body.tool_choice: 'required' needs tools"),
    ("named choice and response_format", line(body=chat(tools=[TOOL], tool_choice=NAMED,
                                                         response_format={"type": "json_object"})),
     contract.INVALID_REQUEST, "body.tool_choice: a forced tool call"),
    ("required and structured_outputs", line(body=chat(tools=[TOOL], tool_choice="required", structured_outputs={"regex": "x"})),
     contract.INVALID_REQUEST, "structured_outputs"),
    ("parallel_tool_calls not a bool", line(body=chat(tools=[TOOL], parallel_tool_calls="no")), contract.INVALID_REQUEST,
     "body.parallel_tool_calls"),
    ("history tool call without id", line(body=chat(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}])),
     contract.INVALID_REQUEST, "body.messages[1].tool_calls[0].id"),
    ("history tool call arguments not a string", line(body=chat(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}])),
     contract.INVALID_REQUEST, "body.messages[1].tool_calls[0].function.arguments"),
    ("tool_call_id not a string", line(body=chat(messages=[
        {"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": 5, "content": "x"}])),
     contract.INVALID_REQUEST, "body.messages[1].tool_call_id"),
    # /v1/responses: what only a server with stored state or hosted tools could do, named by field.
    ("responses previous_response_id", responses_line(previous_response_id="resp_1"), contract.INVALID_REQUEST,
     "body.previous_response_id: a response stored on a server"),
    ("responses conversation", responses_line(conversation={"id": "conv_1"}), contract.INVALID_REQUEST,
     "body.conversation: a conversation stored on a server"),
    ("responses stored prompt", responses_line(prompt={"id": "pmpt_1"}), contract.INVALID_REQUEST, "body.prompt"),
    ("responses background", responses_line(background=True), contract.INVALID_REQUEST, "body.background"),
    ("responses stream", responses_line(stream=True), contract.INVALID_REQUEST, "body.stream"),
    ("responses web_search tool", responses_line(tools=[{"type": "web_search"}]), contract.INVALID_REQUEST,
     "body.tools[0].type: 'web_search' tools run on OpenAI's servers"),
    ("responses file_search tool", responses_line(tools=[{"type": "function", "name": "f"}, {"type": "file_search"}]),
     contract.INVALID_REQUEST, "body.tools[1].type"),
    ("responses function tool without a name", responses_line(tools=[{"type": "function", "parameters": {}}]),
     contract.INVALID_REQUEST, "body.tools[0]: name: a function tool needs a name"),
    ("responses tool_choice naming no tool", responses_line(tool_choice={"type": "function", "name": "f"}), contract.INVALID_REQUEST,
     "body.tool_choice: 'f' is not one of the tools (none given)"),
    ("responses hosted tool_choice", responses_line(tool_choice={"type": "web_search_preview"}), contract.INVALID_REQUEST,
     "body.tool_choice: \"web_search_preview\": only function tools can run in an offline batch"),
    ("responses without input", responses_line(input=None), contract.INVALID_REQUEST, "body.input"),
    ("responses empty input list", responses_line(input=[]), contract.INVALID_REQUEST, "body.input"),
    ("responses image input", responses_line(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     contract.INVALID_REQUEST, "body.input[0].content[0].image_url: 'tiny-model' does not take images (a text-only model)"),
    ("responses item reference", responses_line(input=[{"type": "item_reference", "id": "msg_1"}]),
     contract.INVALID_REQUEST, "body.input[0]"),
    ("responses call output without call_id", responses_line(input=[{"type": "function_call_output", "output": "x"}]),
     contract.INVALID_REQUEST, "body.input[0].call_id"),
    ("responses tool role", responses_line(input=[{"role": "tool", "content": "x"}]), contract.INVALID_REQUEST,
     "body.input[0].role"),
    ("responses max_output_tokens zero", responses_line(max_output_tokens=0), contract.INVALID_REQUEST, "body.max_output_tokens"),
    ("responses temperature too high", responses_line(temperature=2.5), contract.INVALID_REQUEST, "body.temperature"),
    ("responses bad text format", responses_line(text={"format": {"type": "xml"}}), contract.INVALID_REQUEST, "body.text.format.type"),
    ("responses json_schema without schema", responses_line(text={"format": {"type": "json_schema", "name": "x"}}),
     contract.INVALID_REQUEST, "body.text.format: schema is required"),
    ("responses unknown effort", responses_line(reasoning={"effort": "max"}), contract.INVALID_REQUEST, "body.reasoning.effort"),
    ("responses metadata not strings", responses_line(metadata={"k": 1}), contract.INVALID_REQUEST, "body.metadata.k"),
    ("responses unknown model", responses_line(model="gpt-4o"), contract.MODEL_NOT_FOUND, "/v1/responses serves 'tiny-model'"),
    ("responses embedding model", responses_line(model="embed-model"), contract.MODEL_NOT_FOUND, "'embed-model'"),
]


@pytest.mark.parametrize(
    "raw,code,needle", [v[1:] for v in INVALID], ids=[v[0] for v in INVALID]
)
def test_invalid_lines_name_line_code_and_field(raw, code, needle):
    result = check(raw, number=42)
    assert isinstance(result, InvalidLine), result
    assert result.code == code
    assert result.line == 42
    assert result.message.startswith("line 42: ")
    assert needle in result.message


def test_custom_id_is_salvaged_from_a_truncated_line():
    result = check(b'{"custom_id": "task-9", "method": "POST", "body": {"mess')
    assert isinstance(result, InvalidLine) and result.custom_id == "task-9"


def test_line_over_the_size_limit_is_rejected_without_parsing():
    validator = LineValidator(ValidationSettings(MODEL, max_line_bytes=100))
    result = validator.validate(1, line(body=chat(messages=[{"role": "user", "content": "x" * 200}])))
    assert isinstance(result, InvalidLine) and result.code == contract.INVALID_REQUEST
    assert "over the limit of 100" in result.message and result.custom_id == "r1"


def test_repeated_custom_id_first_runs_later_are_duplicates():
    validator = LineValidator(SETTINGS)
    first = validator.validate(1, line(custom_id="same"))
    second = validator.validate(2, line(custom_id="same"))
    third = validator.validate(3, line(custom_id="same"))
    assert isinstance(first, ValidLine)
    assert isinstance(second, InvalidLine) and second.code == contract.DUPLICATE_CUSTOM_ID and second.line == 2
    assert isinstance(third, InvalidLine) and third.code == contract.DUPLICATE_CUSTOM_ID


def test_physical_lines_tolerate_bom_crlf_blank_lines_and_no_final_newline():
    data = b"\xef\xbb\xbf" + line(custom_id="a") + b"\r\n\r\n   \n" + line(custom_id="b") + b"\r\n" + line(custom_id="c")
    valid, invalid = [], []
    summary = validate_stream(io.BytesIO(data), SETTINGS, valid.append, invalid.append)
    assert [(r.line, r.custom_id) for r in valid] == [(1, "a"), (4, "b"), (5, "c")]
    assert invalid == [] and summary.lines == 3
    assert summary.sha256 == hashlib.sha256(data).hexdigest()  # the checksum covers the raw bytes, BOM included


def test_validate_stream_counts_and_routes_every_line():
    data = b"\n".join([line(custom_id="a"), b"[1]", line(custom_id="a"), b"", line(custom_id="b", method="GET"), line(custom_id="c")])
    valid, invalid = [], []
    summary = validate_stream(io.BytesIO(data), SETTINGS, valid.append, invalid.append)
    assert [r.custom_id for r in valid] == ["a", "c"]
    assert [(i.line, i.code) for i in invalid] == [(2, contract.INVALID_REQUEST), (3, contract.DUPLICATE_CUSTOM_ID), (5, contract.INVALID_METHOD)]
    assert (summary.lines, summary.valid, summary.invalid) == (5, 2, 3)
    assert summary.endpoint == contract.CHAT_URL and summary.file_error() is None
    assert len(summary.sha256) == 64 and summary.bytes_read == len(data)


@pytest.mark.parametrize(
    "data,code",
    [(b"", "empty_file"), (b"\n\n  \n", "empty_file"), (b"[1]\nnot json\n", "no_valid_lines")],
    ids=["empty", "only blank lines", "only bad lines"],
)
def test_file_level_failures(data, code):
    summary = validate_stream(io.BytesIO(data), SETTINGS, lambda r: None, lambda i: None)
    error = summary.file_error()
    assert error is not None and error.code == code


def test_validation_memory_does_not_grow_with_file_size():
    """Streaming: 20x more lines must not cost anywhere near 20x the memory (only id digests grow)."""

    def peak(n: int) -> int:
        data = b"\n".join(line(custom_id=f"id-{i}") for i in range(n))
        tracemalloc.start()
        validate_stream(io.BytesIO(data), SETTINGS, lambda r: None, lambda i: None)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(500), peak(10_000)
    # The id set grows ~100 bytes per line; the parsed lines themselves must not accumulate.
    assert large - small < 10_000 * 400, (small, large)


def test_id_set_finds_every_repeat_across_growth():
    from batch_pipeline.steps.validation import IdSet

    ids = IdSet(capacity=8)
    assert all(ids.add(f"id-{i}") for i in range(5000))
    assert len(ids) == 5000
    assert not any(ids.add(f"id-{i}") for i in range(5000))
    assert ids.add("id-5000") and not ids.add("id-5000")


def fast_accept(raw: bytes):
    """What validation does with a line first: the fast schema's parse, or None (the pydantic path)."""
    try:
        return fastpath.decoder.decode(raw)
    except fastpath.ERRORS:
        return None


@pytest.mark.parametrize("raw", [v[1] for v in INVALID], ids=[v[0] for v in INVALID])
def test_fast_path_never_accepts_an_invalid_line(raw):
    """The C fast path may only accept what the authoritative pydantic rules accept."""
    fast = fast_accept(raw)
    if fast is None:
        return
    # Accepted shapes must still fail the checks done beside the fast path (method, model, id length).
    url = fastpath.URLS[type(fast)]
    assert (
        fast.method.upper() != "POST"
        or fast.body.model not in SETTINGS.models_for(url)
        or len(fast.custom_id) > SETTINGS.max_custom_id_length
    ), raw


@pytest.mark.parametrize("raw", [v[1] for v in VALID], ids=[v[0] for v in VALID])
def test_fast_path_accepts_the_common_valid_lines(raw):
    assert fast_accept(raw) is not None


def test_the_fast_path_declares_exactly_the_ignored_and_extension_fields():
    """The fast schemas list contract's ignored fields and vLLM extensions by hand: kept in step."""
    sampling = set(fastpath._Sampling.__struct_fields__)
    assert contract.IGNORED_FIELDS <= sampling and set(contract.VLLM_SAMPLING_EXTRAS) <= sampling
    assert contract.IGNORED_FIELDS <= set(fastpath._EmbeddingBody.__struct_fields__)
    assert not set(contract.REFUSED_FIELDS) & sampling
    # Chat declares the tool fields that completions and embeddings refuse; the fast chat body may too.
    assert set(contract.REFUSED_FIELDS) & set(fastpath._ChatBody.__struct_fields__) <= set(contract.ChatBody.model_fields)


def test_a_batch_endpoint_makes_lines_of_another_url_url_mismatch_errors():
    """The Batch API's `endpoint`: a line with another (supported) url is a url_mismatch error line
    naming the line, the url and the endpoint, on the fast path's input as on the slow path's; a
    line of the endpoint stays valid, and without an endpoint every supported url is."""
    settings = ValidationSettings(served_model_name=MODEL, embedding_model_name="embed-model", endpoint=contract.CHAT_URL)
    validator = LineValidator(settings)
    embedding = line("e1", url=contract.EMBEDDINGS_URL, body={"model": "embed-model", "input": "hi"})
    assert fastpath.decoder.decode(embedding) is not None  # the fast path decodes it: it must not wave it through
    result = validator.validate(3, embedding)
    assert isinstance(result, InvalidLine)
    assert result.code == contract.URL_MISMATCH == "url_mismatch"
    assert result.custom_id == "e1"
    assert result.message.startswith("line 3: url: /v1/embeddings")
    assert "endpoint /v1/chat/completions" in result.message
    assert isinstance(validator.validate(4, line("c1")), ValidLine)
    unsupported = validator.validate(5, line("u1", url="/v1/images"))
    assert isinstance(unsupported, InvalidLine) and unsupported.code == contract.UNSUPPORTED_URL
    assert isinstance(LineValidator(SETTINGS).validate(3, embedding), ValidLine)

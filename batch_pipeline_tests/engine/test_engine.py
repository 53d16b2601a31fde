"""The vLLM engine wrapper (engine/local.py, engine/generation.py) against real vLLM on the CPU, with the tiny random Llama.

Covers the mapping of body fields to sampling parameters, the OpenAI response bodies (parsed with
the official `openai` SDK types), context-length handling and per-request failure isolation. Does
not touch Dagster or storage; answers are gibberish here (real answers: test_e2e_smollm2.py).
"""

from __future__ import annotations

import base64
import struct

import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.engine.local import Engines
from batch_pipeline_tests.support import EMBED_NAME, TINY_MAX_MODEL_LEN, TINY_NAME


@pytest.fixture
def engines(tiny_llm):
    with tiny_llm.open(log=lambda _m: None) as e:
        yield e


def req(line: int, url: str = contract.CHAT_URL, **body) -> contract.BatchRequest:
    if url == contract.CHAT_URL:
        body.setdefault("messages", [{"role": "user", "content": "hello there"}])
    body.setdefault("model", EMBED_NAME if url == contract.EMBEDDINGS_URL else TINY_NAME)
    return contract.BatchRequest(line=line, custom_id=f"id-{line}", url=url, body=body)


def run(engines: Engines, *requests: contract.BatchRequest) -> dict[int, dict]:
    answers = list(engines.stream("batch_test", list(requests), created=1_700_000_000))
    assert sorted(a.line for a in answers) == sorted(r.line for r in requests)  # exactly once
    return {a.line: a.record for a in answers}


def body_of(record: dict) -> dict:
    assert record["error"] is None and record["response"]["status_code"] == 200, record
    return record["response"]["body"]


def test_chat_body_parses_with_openai_types_and_counts_tokens(engines):
    record = run(engines, req(1, max_tokens=7, temperature=0))[1]
    assert record["custom_id"] == "id-1" and record["id"].startswith("batch_req_")
    assert record["response"]["request_id"].startswith("req_")
    completion = ChatCompletion.model_validate(body_of(record))
    assert completion.object == "chat.completion" and completion.model == TINY_NAME
    assert completion.choices[0].message.role == "assistant"
    assert 1 <= completion.usage.completion_tokens <= 7
    assert completion.usage.prompt_tokens > 3
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_n_gives_n_choices_and_seed_makes_sampling_repeatable(engines):
    ask = dict(n=3, max_tokens=8, temperature=1.0, seed=1234)
    first, second = run(engines, req(1, **ask), req(2, **ask)).values()
    a, b = ChatCompletion.model_validate(body_of(first)), ChatCompletion.model_validate(body_of(second))
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]


def test_max_tokens_and_stop_are_honoured(engines):
    greedy = ChatCompletion.model_validate(body_of(run(engines, req(1, max_tokens=12, temperature=0))[1]))
    text = greedy.choices[0].message.content
    assert greedy.choices[0].finish_reason == "length" and greedy.usage.completion_tokens == 12
    stop = text[0]  # the random model's greedy text is mostly newlines: stop on its first character
    stopped = ChatCompletion.model_validate(body_of(run(engines, req(2, max_tokens=12, temperature=0, stop=[stop]))[2]))
    assert stop not in stopped.choices[0].message.content
    assert stopped.usage.completion_tokens < 12


def test_chat_logprobs_have_top_k_alternatives(engines):
    body = body_of(run(engines, req(1, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3))[1])
    completion = ChatCompletion.model_validate(body)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-4)


def test_completions_with_list_prompt_echo_and_logprobs(engines, tiny_model_dir):
    from transformers import AutoTokenizer

    body = body_of(
        run(engines, req(1, url=contract.COMPLETIONS_URL, prompt=["The sky", "Rivers"], max_tokens=3, echo=True, logprobs=2, n=2,
                         ignore_eos=True))[1]  # 3 tokens each, whatever is sampled
    )
    # The SDK types a token's logprob as a float, yet the echoed prompt's first has none (null, as OpenAI
    # and vLLM's server send it; the SDK reads responses without validating them): validated without them.
    completion = Completion.model_validate({**body, "choices": [{**c, "logprobs": None} for c in body["choices"]]})
    assert completion.object == "text_completion"
    assert [ch.index for ch in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text.startswith("The sky") and completion.choices[2].text.startswith("Rivers")
    # Echoed: the logprobs cover each prompt's tokens, then the 3 generated ones; the prompt's first
    # token has none (nothing comes before it).
    logprobs = [c["logprobs"] for c in body["choices"]]
    counts = [len(lp["tokens"]) for lp in logprobs]
    assert counts[0] == counts[1] and counts[2] == counts[3] and completion.usage.prompt_tokens == counts[0] + counts[2] - 6
    for lp in logprobs:
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert all(value <= 0 for value in lp["token_logprobs"][1:])
        # logprobs=2: the top 2, and the chosen token when outside them. (Not "at least 2": sampled, a
        # token can be a partial UTF-8 byte that decodes to "" as another top token does, and the dict,
        # keyed by text, holds one: 2 rounds in 80 here; it failed CI once.)
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
    # The prompt's part is the prompt's tokens, as the model's tokenizer counts them.
    prompt_part = counts[0] - 3
    assert prompt_part == len(AutoTokenizer.from_pretrained(tiny_model_dir).encode("The sky"))
    assert all(len(top) >= 2 for top in logprobs[0]["top_logprobs"][1:prompt_part])  # the prompt: the same each run


def test_completions_default_to_16_tokens_like_openai(engines):
    body = body_of(run(engines, req(1, url=contract.COMPLETIONS_URL, prompt="Once upon", temperature=0, ignore_eos=True))[1])
    assert Completion.model_validate(body).usage.completion_tokens <= 16


def test_prompt_over_max_model_len_is_an_error_line_not_an_exception(engines):
    long = "word " * (TINY_MAX_MODEL_LEN * 2)
    records = run(engines, req(1, messages=[{"role": "user", "content": long}]), req(2, max_tokens=2))
    assert records[1]["response"] is None
    assert records[1]["error"]["code"] == contract.CONTEXT_LENGTH_EXCEEDED and records[1]["error"]["line"] == 1
    assert f"MAX_MODEL_LEN is {TINY_MAX_MODEL_LEN}" in records[1]["error"]["message"]
    body_of(records[2])  # the neighbour still ran


def test_max_tokens_beyond_the_room_left_is_clamped(engines):
    tokenizer = engines.generation.tokenizer
    prompt = "a b c d " * 20
    prompt_tokens = len(tokenizer.encode(prompt))
    room = TINY_MAX_MODEL_LEN - prompt_tokens
    body = body_of(
        run(engines, req(1, url=contract.COMPLETIONS_URL, prompt=prompt, max_tokens=TINY_MAX_MODEL_LEN * 4, temperature=0, ignore_eos=True))[1]
    )
    usage = Completion.model_validate(body).usage
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == room


def test_a_request_the_engine_rejects_fails_alone(engines):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    records = run(engines, req(1, max_tokens=3), req(2, max_tokens=3, response_format=bad_schema), req(3, max_tokens=3))
    body_of(records[1]), body_of(records[3])
    rejected = records[2]
    assert rejected["response"]["status_code"] == 400
    assert rejected["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert rejected["response"]["body"]["error"]["message"]


def test_json_object_output_is_constrained(engines):
    body = body_of(run(engines, req(1, max_tokens=40, temperature=0, response_format={"type": "json_object"}))[1])
    text = ChatCompletion.model_validate(body).choices[0].message.content.strip()
    assert text.startswith("{")


def test_embeddings_float_and_base64(engines):
    records = run(
        engines,
        req(1, url=contract.EMBEDDINGS_URL, input=["hello", "world"]),
        req(2, url=contract.EMBEDDINGS_URL, input="hello", encoding_format="base64"),
    )
    floats = CreateEmbeddingResponse.model_validate(body_of(records[1]))
    assert [d.index for d in floats.data] == [0, 1] and len(floats.data[0].embedding) == 384
    assert floats.usage.prompt_tokens > 0
    raw = base64.b64decode(body_of(records[2])["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert vector == pytest.approx(floats.data[0].embedding, abs=1e-5)
    assert sum(v * v for v in vector) == pytest.approx(1.0, abs=1e-3)  # normalised like sentence-transformers


def test_embedding_dimensions_the_model_cannot_do_is_a_400(engines):
    record = run(engines, req(1, url=contract.EMBEDDINGS_URL, input="x", dimensions=8))[1]
    assert record["response"]["status_code"] == 400
    assert "dimensions" in record["response"]["body"]["error"]["message"]


def test_a_model_load_reports_its_phase_and_time_while_it_runs(tiny_llm, monkeypatch):
    import time

    from batch_pipeline.engine import local as engines_module
    from batch_pipeline_tests.support import SessionLLM

    class SlowLoad(SessionLLM):
        """The session's real engine, reached after 0.4 s: a load long enough to beat during (a
        second real engine in this process would tear down the shared one's parallel state)."""

        def build_engine(self, kwargs):
            time.sleep(0.4)  # the scenario: a deliberately slow load
            return super().build_engine(kwargs)

    monkeypatch.setattr(engines_module, "LOAD_PROGRESS_SECONDS", 0.1)
    messages: list[str] = []
    with tiny_llm.rebuilt(SlowLoad).open(log=messages.append) as engines:
        run(engines, req(1, max_tokens=2))
    loading = [m for m in messages if m.startswith(f"loading generate model {TINY_NAME}: ")]
    assert loading, messages
    assert all(m.endswith("s so far") for m in loading)
    assert all("building the engine (weights, KV cache, warm-up)" in m for m in loading)  # vLLM is imported
    loaded = next(i for i, m in enumerate(messages) if m.startswith(f"generate model {TINY_NAME} loaded in"))
    assert messages.index(loading[-1]) < loaded  # no beat after the load finished


def test_vllm_sampling_extensions_reach_the_engine(engines):
    """allowed_token_ids (one of vLLM's extensions) leaves the model one token to choose."""
    record = run(engines, req(1, max_tokens=3, temperature=0, allowed_token_ids=[40], ignore_eos=True))[1]
    content = ChatCompletion.model_validate(body_of(record)).choices[0].message.content
    assert content == engines.generation.tokenizer.decode([40, 40, 40])


def test_prefix_cache_hits_are_reported_as_cached_tokens(engines):
    """Lines sharing a long prefix: the later ones find it in vLLM's prefix cache, and their usage
    says how many prompt tokens came from there (OpenAI's prompt_tokens_details.cached_tokens)."""
    system = {"role": "system", "content": "You answer questions about the catalogue. " * 20}
    ask = lambda i, text: req(i, messages=[system, {"role": "user", "content": text}], max_tokens=2)  # noqa: E731
    first = ChatCompletion.model_validate(body_of(run(engines, ask(1, "first question"))[1]))
    later = ChatCompletion.model_validate(body_of(run(engines, ask(2, "second question"))[2]))
    assert first.usage.prompt_tokens > 200
    cached = later.usage.prompt_tokens_details.cached_tokens
    # Whole KV blocks of the shared system prompt: most of the prompt, never all of it.
    assert 100 < cached < later.usage.prompt_tokens, (cached, later.usage.prompt_tokens)

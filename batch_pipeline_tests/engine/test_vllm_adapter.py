"""Pins what engine/vllm_adapter.py relies on in the installed vLLM build, on the real engine.

The streaming loop uses a few engine-level calls beyond vLLM's documented offline API (how the ids
`enqueue` returns map to the ids of step() outputs, step/abort/has_unfinished, the scheduler's
max_num_seqs, how a prompt with no room in the context is refused), and the reasoning and tool parser registries reasoning.py and tool_calls.py use. A vLLM upgrade that changes one of them fails here, not in a production run.
Uses the session's tiny-model engine (support/engines.py); leaves it with no request in flight.
"""

from __future__ import annotations

import gc

import pytest

from batch_pipeline.engine import vllm_adapter
from batch_pipeline.engine.engine_args import engine_kwargs
from batch_pipeline_tests.support import TINY_MAX_MODEL_LEN, TINY_NAME, wait_for


@pytest.fixture
def llm(tiny_llm, tiny_model_dir):
    engine = tiny_llm.build_engine(engine_kwargs(tiny_llm.settings(), str(tiny_model_dir), TINY_NAME, "generate"))
    yield engine
    assert not vllm_adapter.has_unfinished(engine), "a test left requests in the shared engine"


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_enqueued_ids_map_to_the_ids_of_step_outputs(llm):
    enqueued = llm.enqueue(["one", "two", "three"], greedy(3), use_tqdm=False)
    chat = llm.enqueue_chat([[{"role": "user", "content": "hi"}]], greedy(2), use_tqdm=False)
    expected = {vllm_adapter.output_request_id(i) for i in enqueued + chat}
    assert len(expected) == 4
    finished = {}
    while vllm_adapter.has_unfinished(llm):
        for out in vllm_adapter.step(llm):
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == expected
    assert all(len(out.outputs[0].token_ids) in (2, 3) for out in finished.values())


def test_abort_drops_requests_by_their_enqueued_ids(llm):
    enqueued = llm.enqueue(["a long one", "another"], greedy(200), use_tqdm=False)
    vllm_adapter.step(llm)
    assert vllm_adapter.has_unfinished(llm)
    vllm_adapter.abort(llm, enqueued)
    # After an abort the engine may still report the aborted requests for a step or two.
    for _ in range(5):
        if not vllm_adapter.has_unfinished(llm):
            break
        vllm_adapter.step(llm)
    assert not vllm_adapter.has_unfinished(llm)


def test_limits_and_sampling_defaults_come_from_the_engine(llm):
    from vllm import SamplingParams

    assert vllm_adapter.max_model_len(llm) == TINY_MAX_MODEL_LEN
    assert vllm_adapter.max_num_seqs(llm) >= 1
    values = vllm_adapter.default_sampling_values(llm)
    defaults = llm.get_default_sampling_params()
    rebuilt = SamplingParams(**values)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"):
        assert getattr(rebuilt, name) == getattr(defaults, name), name


@pytest.mark.parametrize("extra", [0, 1])
def test_a_prompt_with_no_room_in_the_context_is_refused_when_enqueued_with_its_length(llm, extra):
    """vLLM refuses, when it is added, a prompt longer than max_model_len and one exactly as long (no
    room for an output token); prompt_too_long reads the length from that refusal and from nothing
    else. (generation.py turns it into context_length_exceeded for a prompt its images overflow.)"""
    from vllm.inputs import TokensPrompt

    length = TINY_MAX_MODEL_LEN + extra
    with pytest.raises(Exception) as refused:
        llm.enqueue([TokensPrompt(prompt_token_ids=[5] * length)], greedy(2), use_tqdm=False)
    found = vllm_adapter.prompt_too_long(refused.value)
    assert found is not None and found.tokens == length, str(refused.value)
    # Text over the limit is cut one token past it while tokenized: "at least".
    with pytest.raises(Exception) as refused:
        llm.enqueue(["word " * (TINY_MAX_MODEL_LEN + 100)], greedy(2), use_tqdm=False)
    found = vllm_adapter.prompt_too_long(refused.value)
    assert found is not None and found.tokens > TINY_MAX_MODEL_LEN, str(refused.value)
    assert vllm_adapter.prompt_too_long(ValueError("max_tokens must be at least 1, got 0")) is None


def test_output_request_id_keeps_ids_it_does_not_recognise():
    assert vllm_adapter.output_request_id("12-a1b2c3d4") == "12"
    assert vllm_adapter.output_request_id("custom-id-x") == "custom-id-x"
    assert vllm_adapter.output_request_id("7") == "7"


def test_version_names_the_installed_build():
    dist = vllm_adapter.engine_distribution()
    assert dist is not None and dist[0] in vllm_adapter.ENGINE_DISTRIBUTIONS
    assert vllm_adapter.vllm_version() == f"{dist[0]} {dist[1]}"


def test_shutdown_is_best_effort_on_a_half_built_engine():
    was_frozen = gc.get_freeze_count()
    gc.freeze()  # as build_llm leaves it
    try:
        vllm_adapter.shutdown_llm(object())  # no llm_engine at all: nothing raised
        # ... and the objects build_llm froze are given back to the collector all the same.
        assert gc.get_freeze_count() == 0
    finally:
        if was_frozen:
            gc.freeze()  # the session's engines stay out of the collector's sight, as before


# -- vLLM's logging set-up and the model-load heartbeat -------------------------------------------
# LLM(...) applies vLLM's logging configuration (logging.config.dictConfig) in the thread building
# it, while the heartbeat thread logs through Dagster; the two deadlocked once (a run hung in its model
# load). build_llm applies the configuration first, while no heartbeat logs (progress.LOGGING_SETUP).


def test_llm_finds_its_logging_configuration_applied_and_applies_nothing(tiny_model_dir, monkeypatch):
    import vllm.entrypoints.llm
    import vllm.logger
    from vllm.engine.arg_utils import EngineArgs

    vllm_adapter.configure_vllm_logging()
    applied: list = []
    monkeypatch.setattr(vllm.logger, "dictConfig", applied.append)
    # What LLM(...) and its engine configuration ask for (vllm/entrypoints/llm.py, engine/arg_utils.py).
    assert vllm.entrypoints.llm.configure_logging_if_needed is vllm.logger.configure_logging_if_needed
    vllm.logger.configure_logging_if_needed(EngineArgs(model=str(tiny_model_dir)).create_logging_config())
    assert applied == [], "LLM(...) would apply vLLM's logging configuration again, in its own thread"
    # A different configuration is applied (so the comparison is what keeps it from running twice).
    # (Its default level comes from VLLM_LOGGING_LEVEL, which the CLI sets to ERROR when it runs in
    # this process: the other level is one that differs from it.)
    import dataclasses

    from vllm.config.logging import LoggingConfig

    default = LoggingConfig()
    other = dataclasses.replace(default, log_level="WARNING" if default.log_level != "WARNING" else "ERROR")
    vllm.logger.configure_logging_if_needed(other)
    assert len(applied) == 1
    vllm_adapter.configure_vllm_logging()  # back to the default, for the rest of the session
    assert len(applied) == 2


def test_the_heartbeat_does_not_log_while_logging_is_set_up():
    import time

    from batch_pipeline.base.progress import LOGGING_SETUP, heartbeat

    said: list[str] = []
    with heartbeat(said.append, "loading", every=0.01):
        wait_for("the heartbeat's first line", lambda: said, 10, interval=0.01)
        with LOGGING_SETUP:
            before = len(said)
            time.sleep(0.3)  # the scenario: a set-up lasting 30 heartbeats, in which it must not log
            during = len(said)
        wait_for("the heartbeat going on once the set-up was done", lambda: len(said) > during, 10, interval=0.01)
    assert before == during, "the heartbeat logged while logging was being set up"
    assert said[-1].startswith("loading: ")


def test_reasoning_and_tool_parsers_are_found_by_name_and_unknown_names_raise_key_error():
    # reasoning.py and tool_calls.py reach vLLM's parser registries only through the adapter; the
    # parsers the docs name must be there, and an unknown name must raise KeyError (what both turn
    # into a ConfigError naming the variable).
    assert {"deepseek_r1", "qwen3"} <= set(vllm_adapter.reasoning_parser_names())
    assert {"hermes", "llama3_json"} <= set(vllm_adapter.tool_parser_names())
    assert callable(getattr(vllm_adapter.reasoning_parser_class("deepseek_r1"), "extract_reasoning"))
    assert callable(getattr(vllm_adapter.tool_parser_class("hermes"), "extract_tool_calls"))
    with pytest.raises(KeyError):
        vllm_adapter.reasoning_parser_class("no-such-parser")
    with pytest.raises(KeyError):
        vllm_adapter.tool_parser_class("no-such-parser")


def test_a_tool_parser_request_carries_the_lines_tools():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    request = vllm_adapter.tool_parser_request([tool])
    assert request.tool_choice == "auto"
    assert [t.function.name for t in request.tools] == ["get_weather"]
    assert request.tools[0].function.parameters["required"] == ["city"]



def test_the_suites_model_inspection_writes_what_vllms_registry_reads_back(tiny_model_dir, tmp_path, monkeypatch):
    """support/model_inspection.py fills vLLM's modelinfos cache through the registry's private
    methods: every architecture it names is one vLLM registers, and vLLM's own inspection then reads
    the answer from the cache (its subprocess is made to fail here) and gets what inspecting the
    class gives. A vLLM upgrade that changes them fails here, not silently in the suite's timing."""
    import dataclasses
    import json

    import vllm.model_executor.models.registry as registry

    from batch_pipeline_tests.support import model_inspection

    def normal(info) -> dict:  # as the cache's JSON holds it (tuples read back as lists)
        return json.loads(json.dumps(dataclasses.asdict(info)))

    # vLLM's cache folder, in tmp_path (VLLM_CACHE_ROOT would not do: a worker that built an engine
    # reads vLLM's variables from a cache)
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir",
                        staticmethod(lambda: tmp_path / "vllm" / "modelinfos"))
    assert model_inspection.inspect(tmp_path) == len(model_inspection.ARCHITECTURES)
    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: pytest.fail("vLLM missed the cache"))
    for arch in model_inspection.ARCHITECTURES:
        model = registry.ModelRegistry.models[arch]
        assert isinstance(model, registry._LazyRegisteredModel), arch
        expected = registry._ModelInfo.from_model_cls(model.load_model_cls())
        assert normal(model.inspect_model_cls()) == normal(expected), arch
    assert model_inspection.start(tmp_path) is None  # done: a later run starts nothing

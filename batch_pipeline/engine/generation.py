"""Chat, Responses and completions on one vLLM `LLM`: requests streamed in, one answer per request out.

Chat goes through `LLM.enqueue_chat` (the queueing form of `LLM.chat`: same chat template and
rendering), and so does a `/v1/responses` line, as the chat it amounts to (ResponsesBody.as_chat);
completions through `LLM.enqueue` (the form of `LLM.generate`). Prompts are measured with the
model's own tokenizer first, so an over-long prompt becomes a `context_length_exceeded`
line instead of an exception, and `max_tokens` beyond the room left in the context is clamped to it.

A line's images (chat `image_url`, Responses `input_image`) are fetched and decoded ahead of the
engine by io/images.py's ImageResolver, a bounded window of lines ahead of their turn, and handed to
vLLM decoded (`image_pil` parts), so the engine never fetches. While the next line's images are
still loading, the engine steps what it holds; it waits on images only with nothing else to do
(EngineClock.image_wait). A bad image is that line's error line, naming the line and the part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import copy
import json
import time
from collections import deque

from batch_pipeline import contract
from batch_pipeline.contract import lines
from batch_pipeline.engine import bodies, tool_calls, vllm_adapter
from batch_pipeline.io import images
from batch_pipeline.engine.reasoning import Reasoning, template_takes
from batch_pipeline.contract.lines import Answer

# A request stream may yield this when it has nothing ready yet (a data-parallel rank waiting for
# more from the run process): the engine goes on stepping what it holds and asks again.
NOTHING_YET = object()


class _Feed:
    """A request stream read a little at a time: take() gives the next item, or None when there is
    nothing ready yet (NOTHING_YET) or nothing more (then `exhausted`)."""

    def __init__(self, source: Iterator[Any]) -> None:
        self.source, self.exhausted = source, False

    def take(self) -> Any:
        item = next(self.source, None)
        if item is None:
            self.exhausted = True
        return None if item is NOTHING_YET else item

# vLLM's own extensions to the OpenAI body, honoured as its online server honours them.
VLLM_SAMPLING_EXTRAS = contract.VLLM_SAMPLING_EXTRAS

# Endpoints answered as a chat (LLM.enqueue_chat): /v1/responses lines run as the chat they amount to.
CHAT_URLS = (contract.CHAT_URL, contract.RESPONSES_URL)


@dataclass
class EngineClock:
    """Where the answering time goes: `busy` in engine steps, `active` from a stream's start to its
    end. The rest (active - busy) the engine waited on this process: rendering chat templates and
    tokenizing (prepare), building answers, writing checkpoints. With the engine core in this
    process (the CPU default) that is time the engine was idle; with a multiprocess core (GPUs) the
    core runs on meanwhile, so it is an upper bound."""

    busy: float = 0.0
    active: float = 0.0
    # Of the idle time: waiting on a line's images with nothing else in the engine to step.
    image_wait: float = 0.0

    def idle_share(self, since: "EngineClock | None" = None) -> float | None:
        busy = self.busy - (since.busy if since else 0.0)
        active = self.active - (since.active if since else 0.0)
        return round(max(active - busy, 0.0) / active, 4) if active > 0 else None

    def image_wait_share(self, since: "EngineClock | None" = None) -> float | None:
        waited = self.image_wait - (since.image_wait if since else 0.0)
        active = self.active - (since.active if since else 0.0)
        return round(waited / active, 4) if active > 0 else None


@dataclass
class Prepared:
    """A request ready for the engine: parsed body, prompts and one SamplingParams per prompt."""

    req: contract.BatchRequest
    body: Any
    prompts: list[Any]  # conversations (chat) or strings (completions)
    params: list[Any]
    prompt_lens: list[int] = field(default_factory=list)
    template_kwargs: dict[str, Any] | None = None  # chat only: variables for the chat template
    source: Any = None  # /v1/responses: the line's own body (`body` is the chat it runs as)
    tools: tool_calls.ToolPlan | None = None  # chat only: how the line's tools are used


class GenerationEngine(vllm_adapter.ServedModel):
    """One vLLM `LLM` serving chat and completions for the duration of a run."""

    def __init__(self, llm: Any, served_model_name: str, model_path: str, queue_factor: int = 4, queue_floor: int = 64,
                 reasoning_parser: str = "", lora_modules: dict[str, str] | None = None,
                 tool_call_parser: str = "", clock: EngineClock | None = None,
                 image_settings: images.ImageSettings | None = None):
        super().__init__(llm, served_model_name, model_path)
        self.clock = clock or EngineClock()
        # The image limits (MAX_IMAGE_BYTES, ...); None: read from the environment at the first image.
        self.image_settings = image_settings
        self._defaults = vllm_adapter.default_sampling_values(llm)
        self.queue_factor, self.queue_floor = queue_factor, queue_floor
        # REASONING_PARSER: vLLM's parser splits each chat answer's thinking from its content.
        self.reasoning = Reasoning(reasoning_parser, self.tokenizer, served_model_name) if reasoning_parser else None
        if self.reasoning is not None:
            self._defaults.update(self.reasoning.sampling_overrides)
        # TOOL_CALL_PARSER: vLLM's parser reads tool calls from the answers of tool_choice auto lines.
        self.tool_parser = tool_calls.ToolParser(tool_call_parser, self.tokenizer, served_model_name) if tool_call_parser else None
        # LORA_MODULES: a line naming an adapter in body.model runs with it (vLLM's LoRARequest).
        self.adapters: dict[str, Any] = {}
        if lora_modules:
            from vllm.lora.request import LoRARequest

            self.adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(lora_modules.items())}

    # -- preparation ------------------------------------------------------------------------

    def _count_chat(self, conversation: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> int:
        text = self.tokenizer.apply_chat_template(_as_rendered(_text_only(conversation)), tokenize=False, add_generation_prompt=True,
                                                  tools=tools, **(template_kwargs or {}))
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _count_text(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt))

    def _sampling(self, body: Any, max_tokens: int, logprobs: int | None,
                  tools: tool_calls.ToolPlan | None = None, prompt_logprobs: int | None = None) -> Any:
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
            "prompt_logprobs": prompt_logprobs,  # an echoed completion's prompt (bodies.completion_body)
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if tools is not None:  # what the tool parser asks of decoding; the line's own extras still win
            values.update(tools.sampling)
        extras = body.model_extra or {}
        values.update({k: extras[k] for k in VLLM_SAMPLING_EXTRAS if extras.get(k) is not None})
        if body.logit_bias:
            values["logit_bias"] = dict(body.logit_bias)
        fmt = getattr(body, "response_format", None)
        if tools is not None and tools.schema is not None:  # a forced call (named or required): its JSON
            values["structured_outputs"] = StructuredOutputsParams(json=tools.schema)
        elif body.structured_outputs:
            if fmt is not None and fmt.type != "text":
                raise ValueError("structured_outputs and response_format both constrain the output: give one of them")
            values["structured_outputs"] = StructuredOutputsParams(**body.structured_outputs)
        elif fmt is not None and fmt.type == "json_object":
            values["structured_outputs"] = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            values["structured_outputs"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
        return SamplingParams(**values)

    def _room(self, prompt_len: int, requested: int | None) -> int:
        room = self.max_model_len - prompt_len
        return room if requested is None else min(requested, room)

    def prepare(self, batch_id: str, req: contract.BatchRequest, loaded: tuple[Any, ...] = ()) -> Prepared | Answer:
        """Parse, measure and build sampling params; an Answer when the request cannot run.
        `loaded`: the line's images, decoded (ImageResolver), in the order of its image parts. They
        are not in the measured length (their tokens are the model processor's to count): a prompt
        that overflows with them is refused when it is enqueued (`_refused`: context_length_exceeded),
        and decoding stops at the context's end."""
        try:
            body = source = req.parsed_body()
            template_kwargs, plan = None, None
            if req.url == contract.RESPONSES_URL:
                body = source.as_chat()  # a Response is computed as the chat it amounts to
            if req.url in CHAT_URLS:
                template_kwargs = dict(body.chat_template_kwargs or {})
                if body.reasoning_effort is not None:
                    if not template_takes(self.tokenizer, "reasoning_effort"):
                        field = "reasoning.effort" if req.url == contract.RESPONSES_URL else "reasoning_effort"
                        return lines.contract_error(
                            batch_id, req, contract.INVALID_REQUEST,
                            f"{field}: the chat template of {self.served_model_name} does not take it, so it "
                            "cannot be honoured (a model that thinks on a switch takes chat_template_kwargs instead, "
                            'e.g. {"enable_thinking": false})',
                        )
                    template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
                try:
                    plan = tool_calls.plan(body, self.tool_parser)
                except ValueError as e:
                    return lines.contract_error(batch_id, req, contract.INVALID_REQUEST, f"body.{e}")
                conversation = [_message(m) for m in body.messages]
                lengths = [self._count_chat(conversation, template_kwargs, plan.tools)]
                prompts: list[Any] = [images.chat_messages_with_images(conversation, loaded) if loaded else conversation]
                logprobs = (body.top_logprobs or 0) if body.logprobs else None
                prompt_logprobs = None
            else:
                prompts = body.prompts()
                lengths = [self._count_text(p) for p in prompts]
                logprobs = body.logprobs
                # Echoed with logprobs: the prompt's tokens get theirs too, as vLLM's server asks.
                prompt_logprobs = logprobs if body.echo and logprobs is not None else None
        except Exception as e:  # noqa: BLE001 - a template or tokenizer refusing one request
            return lines.engine_error(batch_id, req, e)
        longest = max(lengths)
        if longest >= self.max_model_len:
            return lines.contract_error(
                batch_id,
                req,
                contract.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {longest} tokens; MAX_MODEL_LEN is {self.max_model_len}, which leaves no room "
                "for output",
            )
        try:
            params = [self._sampling(body, self._room(n, body.token_limit()), logprobs, plan, prompt_logprobs)
                      for n in lengths]
        except Exception as e:  # noqa: BLE001 - vLLM refusing a parameter combination
            return lines.engine_error(batch_id, req, e)
        return Prepared(req=req, body=body, prompts=prompts, params=params, prompt_lens=lengths,
                        template_kwargs=template_kwargs or None,
                        source=source if req.url == contract.RESPONSES_URL else None, tools=plan)

    # -- execution --------------------------------------------------------------------------

    def _enqueue(self, item: Prepared) -> list[str]:
        adapter = self.adapters.get(item.body.model)  # None: the base model
        if item.req.url in CHAT_URLS:
            return self.llm.enqueue_chat(item.prompts, item.params, use_tqdm=False, lora_request=adapter,
                                         chat_template_kwargs=item.template_kwargs,
                                         tools=item.tools.tools if item.tools is not None else None)
        return self.llm.enqueue(item.prompts, item.params, use_tqdm=False, lora_request=adapter)

    def model_name(self, item: Prepared) -> str:
        """The model an answer names: the adapter the line asked for, or the served model."""
        return item.body.model if item.body.model in self.adapters else self.served_model_name

    def window(self) -> int:
        """Requests kept queued in the engine: enough that the scheduler always has a full batch."""
        return max(self.queue_factor * vllm_adapter.max_num_seqs(self.llm), self.queue_floor)

    def stream(self, batch_id: str, requests: Iterable[contract.BatchRequest], created: int) -> Iterator[Answer]:
        """Answer requests as they finish, keeping the engine fed (continuous batching over the
        whole batch, no barriers). Each request is answered exactly once. `batch_id` names the
        batch of requests that do not name their own (BatchRequest.batch_id)."""
        window = self.window()
        pending: dict[str, tuple[Prepared, int, str]] = {}  # output id -> (item, prompt index, enqueued id)
        collected: dict[tuple[str, int], list[Any]] = {}  # (batch, input line) -> outputs per prompt
        clock, began = self.clock, time.perf_counter()
        source = _images_ahead(iter(requests), self._images, lambda: bool(pending), clock)
        feed = _Feed(source)
        try:
            while True:
                while not feed.exhausted and len(pending) < window:
                    got = feed.take()
                    if got is None:
                        break
                    req, loaded = got
                    of = req.batch_id or batch_id
                    if loaded is not None and loaded.error is not None:  # a bad image: this line's error alone
                        yield lines.contract_error(of, req, contract.INVALID_REQUEST, str(loaded.error))
                        continue
                    prepared = self.prepare(of, req, loaded.images if loaded is not None else ())
                    if isinstance(prepared, Answer):
                        yield prepared
                        continue
                    try:
                        enqueued = self._enqueue(prepared)
                    except Exception as e:  # noqa: BLE001 - the engine refused this request (e.g. its schema)
                        yield self._refused(of, req, e, with_images=bool(loaded is not None and loaded.images))
                        continue
                    collected[(of, req.line)] = [None] * len(enqueued)
                    for index, enqueued_id in enumerate(enqueued):
                        pending[vllm_adapter.output_request_id(enqueued_id)] = (prepared, index, enqueued_id)
                if not pending:
                    if feed.exhausted:
                        return
                    continue
                if not vllm_adapter.has_unfinished(self.llm):
                    dropped = sorted(item.req.line for item, _, _ in pending.values())
                    raise RuntimeError(f"the engine dropped {len(pending)} requests (lines {dropped[:10]})")
                stepped = time.perf_counter()
                outputs = vllm_adapter.step(self.llm)
                clock.busy += time.perf_counter() - stepped
                for out in outputs:
                    if not out.finished or out.request_id not in pending:
                        continue
                    item, index, _ = pending.pop(out.request_id)
                    of = item.req.batch_id or batch_id
                    slots = collected[(of, item.req.line)]
                    slots[index] = out
                    if all(slot is not None for slot in slots):
                        del collected[(of, item.req.line)]
                        yield self._answer(of, item, slots, created)
        finally:
            source.close()  # image fetches not started are dropped
            clock.active += time.perf_counter() - began
            if pending:  # interrupted: do not leave half-done requests running in the engine
                vllm_adapter.abort(self.llm, [enqueued_id for _, _, enqueued_id in pending.values()])

    def _refused(self, batch_id: str, req: contract.BatchRequest, exc: Exception, with_images: bool = False) -> Answer:
        """The answer to a request the engine would not take: a prompt its images make longer than
        the context (only vLLM's processor counts image tokens) is `context_length_exceeded`, as for
        a text prompt measured in prepare(); anything else is vLLM's own refusal (a 400 body)."""
        length = vllm_adapter.prompt_too_long(exc)
        if length is None:
            return lines.engine_error(batch_id, req, exc)
        return lines.contract_error(
            batch_id, req, contract.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {'at least ' if length.at_least else ''}{length.tokens} tokens"
            f"{' with its images' if with_images else ''}; MAX_MODEL_LEN is {self.max_model_len}, which leaves no "
            "room for output",
        )

    def _images(self) -> images.ImageResolver:
        if self.image_settings is None:
            self.image_settings = images.image_settings_from_env()
        return images.ImageResolver(self.image_settings)

    def _answer(self, batch_id: str, item: Prepared, outputs: list[Any], created: int) -> Answer:
        if item.req.url == contract.RESPONSES_URL:
            return bodies.responses_body(batch_id, item.req, item.source, item.body, outputs[0], item.params[0],
                                            self.model_name(item), created, reasoning=self.reasoning,
                                            template_kwargs=item.template_kwargs, tools=item.tools,
                                            tool_parser=self.tool_parser)
        if item.req.url == contract.CHAT_URL:
            return bodies.chat_body(batch_id, item.req, item.body, outputs[0], self.model_name(item), created,
                                       reasoning=self.reasoning, template_kwargs=item.template_kwargs,
                                       tools=item.tools, tool_parser=self.tool_parser)
        return bodies.completion_body(
            batch_id, item.req, item.body, item.prompts, outputs, self.model_name(item), created,
            decode=self.tokenizer.decode,
        )


def _images_ahead(requests: Iterator[Any], resolver: Callable[[], images.ImageResolver], busy: Callable[[], bool],
                  clock: EngineClock) -> Iterator[Any]:
    """The requests in their order, each as (request, its LineImages or None when it has no image),
    the images of the next lines loading meanwhile on the resolver's pool (a window of 4 x
    IMAGE_FETCH_CONCURRENCY lines ahead). When the next line's images are not ready and the engine
    holds work (`busy`), NOTHING_YET: the engine steps instead of waiting; otherwise the wait is
    counted in `clock.image_wait`. The resolver is made at the first image, and closed at the end."""
    pool: images.ImageResolver | None = None
    ahead: deque[tuple[Any, Any]] = deque()  # (request, Future[LineImages] or None)
    feed = _Feed(requests)
    try:
        while True:
            lookahead = 4 * pool.settings.concurrency if pool is not None else 1
            while not feed.exhausted and len(ahead) < lookahead:
                req = feed.take()
                if req is None:
                    break
                future = None
                if req.url in CHAT_URLS and isinstance(req.body, dict) and images.has_images(req.url, req.body):
                    pool = pool or resolver()
                    future = pool.submit(req.line, req.url, req.body)
                ahead.append((req, future))
                lookahead = 4 * pool.settings.concurrency if pool is not None else 1
            if not ahead:
                if feed.exhausted:
                    return
                yield NOTHING_YET
                continue
            req, future = ahead[0]
            if future is not None and not future.done():
                if busy():
                    yield NOTHING_YET
                    continue
                waited = time.perf_counter()
                future.result()
                clock.image_wait += time.perf_counter() - waited
            ahead.popleft()
            yield req, future.result() if future is not None else None
    finally:
        if pool is not None:
            # Not waiting: an interrupted stream (a terminate, a deadline) returns at once instead of
            # after a slow host's timeout; a fetch still running finishes in its thread, unused.
            pool.close(wait=False)


def _message(m: contract.ChatMessage) -> dict[str, Any]:
    """A chat message as it goes to vLLM (OpenAI's shape): tool calls and tool results kept; with
    images, its content parts in order (each image part to be replaced by the decoded image)."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.images():
        message["content"] = [{"type": "image_url", "image_url": {"url": p.image_url.url}} if isinstance(p, contract.ImagePart)
                              else {"type": "text", "text": p.text} for p in m.content]
    if m.tool_calls:
        message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _text_only(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each message's content parts joined into its text (how it is measured:
    a chat template may take a string only, and the images' tokens are the processor's to count)."""
    if not any(isinstance(m.get("content"), list) for m in conversation):
        return conversation
    return [{**m, "content": "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")}
            if isinstance(m.get("content"), list) else m for m in conversation]


def _as_rendered(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as vLLM hands it to the chat template: tool call arguments as objects, not
    JSON strings (an argument string that is not a JSON object becomes {}, as vLLM makes it)."""
    if not any("tool_calls" in m for m in conversation):
        return conversation
    rendered = copy.deepcopy(conversation)
    for message in rendered:
        for call in message.get("tool_calls") or []:
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                arguments = {}
            call["function"]["arguments"] = arguments if isinstance(arguments, dict) else {}
    return rendered

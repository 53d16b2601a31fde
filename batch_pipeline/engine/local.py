"""The engines of one run: built on first use, fed one stream of mixed requests, always shut down."""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from batch_pipeline import contract
from batch_pipeline.engine.embeddings import EmbeddingEngine
from batch_pipeline.engine.engine_args import engine_kwargs
from batch_pipeline.engine.generation import NOTHING_YET, EngineClock, GenerationEngine
from batch_pipeline.base.progress import PROGRESS_SECONDS, heartbeat
from batch_pipeline.contract.lines import Answer
from batch_pipeline.engine.scoring import ScoringEngine
from batch_pipeline.config.model_versions import verify_checksums, versioned_name
from batch_pipeline.config.settings import ConfigError, EngineSettings
from batch_pipeline.engine.vllm_adapter import build_llm, shutdown_llm

EMBEDDING_CHUNK = 64  # pooling requests (embeddings, score, rerank) answered together
POOLING_URLS = (contract.EMBEDDINGS_URL, *contract.SCORING_URLS)
LOAD_PROGRESS_SECONDS = PROGRESS_SECONDS  # how often a model load says where it is


def load_phase() -> str:
    """What a model load is doing, as far as can be told from outside vLLM."""
    if "vllm.entrypoints.llm" not in sys.modules:
        return "importing vLLM and torch"
    return "building the engine (weights, KV cache, warm-up)"


class Engines:
    """The generation and the embedding engine, each built only when its first request comes."""

    data_parallel_size = 1  # one engine, in this process (RankedEngines: one per rank process)
    rank_peak_memory_mb: list[float] = []  # no rank processes: the run process's peak says it all
    takes_at_once = 1  # requests fed at once, whatever their order (RemoteEngines: its window): 1, the plan decides
    figures = None  # a warm engine's own figures over a stream (RemoteEngines); none in this process

    def __init__(
        self,
        settings: EngineSettings,
        model_path: str,
        served_name: str,
        embedding_path: str | None,
        embedding_name: str | None,
        log: Callable[[str], None] = lambda _m: None,
        builder: Callable[[dict[str, Any]], Any] = build_llm,
        queue_factor: int = 4,
        queue_floor: int = 64,
        owns: bool = True,
    ):
        self.settings = settings
        # MODELS_FILE: more generation models, by served name; loaded one at a time (see _model).
        self.registry = settings.model_registry()
        if served_name in self.registry:
            raise ConfigError(f"MODELS_FILE={settings.models_file}: {served_name!r} is already the served model")
        # Versioned models: plain `name` answers with the version this run resolved (the resource pins
        # every one in MODEL_VERSIONS before the engines open; unpinned: MODELS_FILE's current).
        self.versions = settings.resolved_versions({})
        self.aliases = {name: versioned_name(name, version) for name, version in self.versions.items()}
        self.checksums = settings.weight_checksums()  # every entry that lists sha256, versioned or not
        self.owns = owns  # False: engines are shared beyond this object (tests), never shut down here
        self.model_path = model_path
        self.served_name = served_name
        self.embedding_path = embedding_path
        self.embedding_name = embedding_name
        self.log = log
        self.builder = builder
        self.queue = (queue_factor, queue_floor)  # requests kept in the engine: see GenerationEngine.window
        self._generation: GenerationEngine | None = None  # the default model's (MODEL_PATH)
        self._others: dict[str, GenerationEngine] = {}  # MODELS_FILE models, at most one at a time
        self._embedding: EmbeddingEngine | None = None
        self._scoring: ScoringEngine | None = None
        self._unused: list[Any] = []  # engines built but not wrapped (their wrapper refused the model)
        self.load_seconds = 0.0
        self.clock = EngineClock()  # engine steps against answering time, over every generation engine

    def _build(self, runner: str, path: str, name: str, settings: EngineSettings | None = None) -> Any:
        started = time.perf_counter()
        self.log(f"loading {runner} model {name} from {path}")
        with heartbeat(self.log, f"loading {runner} model {name}", load_phase, LOAD_PROGRESS_SECONDS):
            llm = self.builder(engine_kwargs(settings or self.settings, path, name, runner))
        elapsed = time.perf_counter() - started
        self.load_seconds += elapsed
        self.log(f"{runner} model {name} loaded in {elapsed:.1f}s")
        return llm

    def _generation_engine(self, settings: EngineSettings, path: str, name: str) -> GenerationEngine:
        llm = self._build("generate", path, name, settings)
        try:
            return GenerationEngine(llm, name, path, *self.queue, reasoning_parser=settings.reasoning_parser,
                                    lora_modules=settings.lora_adapters(), tool_call_parser=settings.tool_call_parser,
                                    clock=self.clock)
        except Exception:
            self._unused.append(llm)  # e.g. a REASONING_PARSER or TOOL_CALL_PARSER that does not fit: shut down in close()
            raise

    @property
    def generation(self) -> GenerationEngine:
        """The default model's engine (MODEL_PATH, with its LoRA adapters)."""
        if self._generation is None:
            self._release_others()
            self._generation = self._generation_engine(self.settings, self.model_path, self.served_name)
        return self._generation

    def _model(self, name: str | None) -> GenerationEngine:
        """The engine of a served model name: a MODELS_FILE model, else the default model. Only one
        generation model is held at a time (two 8B models do not fit one GPU's memory side by side):
        loading another first shuts down the one loaded."""
        if name not in self.registry:
            return self.generation
        if name not in self._others:
            self._release_others()
            if self._generation is not None:
                self._shutdown(self._generation)
                self._generation = None
            settings = self.registry[name]
            if name in self.checksums:  # a changed or truncated weight file is refused before vLLM reads it
                read = verify_checksums(name, Path(settings.model_path), self.checksums[name], log=self.log)
                self.log(f"{name}: weight checksums verified ({read} file(s) read, the rest unchanged since "
                         "their last check)")
            self._others[name] = self._generation_engine(settings, settings.model_path, name)
        return self._others[name]

    def _release_others(self) -> None:
        for engine in self._others.values():
            self._shutdown(engine)
        self._others.clear()

    def _shutdown(self, engine: Any) -> None:
        if self.owns:
            shutdown_llm(engine.llm)

    def model_of(self, req: contract.BatchRequest) -> str | None:
        """Which generation model answers a request: a MODELS_FILE name, or None (the default model)."""
        name = req.body.get("model") if isinstance(req.body, dict) else None
        name = self.aliases.get(name, name)
        return name if name in self.registry else None

    @property
    def embedding(self) -> EmbeddingEngine:
        if self._embedding is None:
            if not self.embedding_path or not self.embedding_name:
                raise RuntimeError("no embedding model is configured (EMBEDDING_MODEL_PATH)")
            llm = self._build("pooling", self.embedding_path, self.embedding_name)
            self._embedding = EmbeddingEngine(llm, self.embedding_name, self.embedding_path)
        return self._embedding

    @property
    def scoring(self) -> ScoringEngine:
        """SCORE_MODEL_PATH's cross-encoder, or the embedding model's engine (a bi-encoder)."""
        if self._scoring is None:
            own = self.settings.score_model()
            if own is None:
                embedding = self.embedding
                self._scoring = ScoringEngine(embedding.llm, embedding.served_model_name, embedding.model_path)
            else:
                path, name = own
                self._scoring = ScoringEngine(self._build("pooling", path, name), name, path)
        return self._scoring

    def _pooled(self, batch_id: str, requests: list[contract.BatchRequest], created: int) -> list[Answer]:
        embeddings = [r for r in requests if r.url == contract.EMBEDDINGS_URL]
        scored = [r for r in requests if r.url != contract.EMBEDDINGS_URL]
        return ((self.embedding.run(batch_id, embeddings) if embeddings else [])
                + (self.scoring.run(batch_id, scored, created) if scored else []))

    def stream(self, batch_id: str, requests: Iterable[contract.BatchRequest], created: int,
               expected: int | None = None) -> Iterator[Answer]:
        """Answer a stream of mixed requests, each exactly once, in the order they finish.
        (`expected`, the stream's length, matters only to RankedEngines.)"""
        ready: deque[Answer] = deque()
        pooled: list[contract.BatchRequest] = []  # embeddings, score and rerank: the pooling models
        # With MODELS_FILE: the first generation request's model answers the stream; requests for
        # other models wait here and are answered after it, one model at a time.
        later: dict[str | None, list[contract.BatchRequest]] = {}
        current: list[str | None] = []

        def generation_only() -> Iterator[contract.BatchRequest]:
            for req in requests:
                if req is NOTHING_YET:
                    yield req
                    continue
                if req.url not in POOLING_URLS:
                    model = self.model_of(req) if self.registry else None
                    if not current:
                        current.append(model)
                    if model != current[0]:
                        later.setdefault(model, []).append(req)
                        continue
                    yield req
                    continue
                pooled.append(req)
                if len(pooled) >= EMBEDDING_CHUNK:
                    ready.extend(self._pooled(batch_id, pooled, created))
                    pooled.clear()

        generation = generation_only()
        first = next(generation, None)
        while first is NOTHING_YET:  # no model is built before its first request is known
            first = next(generation, None)
        if first is not None:
            for answer in self._model(current[0]).stream(batch_id, itertools.chain([first], generation), created):
                yield answer
                while ready:
                    yield ready.popleft()
        for model, waiting in later.items():
            self.log(f"{len(waiting)} request(s) for model {model or self.served_name}: answering them next")
            for answer in self._model(model).stream(batch_id, waiting, created):
                yield answer
                while ready:
                    yield ready.popleft()
        if pooled:
            ready.extend(self._pooled(batch_id, pooled, created))
        while ready:
            yield ready.popleft()

    def close(self) -> None:
        shared = self._embedding.llm if self._embedding is not None else None
        scoring = self._scoring if self._scoring is not None and self._scoring.llm is not shared else None
        for engine in (self._generation, self._embedding, scoring, *self._others.values()):
            if engine is not None:
                shutdown_llm(engine.llm)
        for llm in self._unused:
            shutdown_llm(llm)
        self._generation = self._embedding = self._scoring = None
        self._others.clear()
        self._unused.clear()

"""Resources: the vLLM engines (`llm`) and where batches are read and written (`storage`).

Every field left blank in the launchpad falls back to the environment variable of the same name
(docs/CONFIGURATION.md), read when the run starts, never at import.
"""


import dataclasses
import json
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field, PrivateAttr, create_model

from batch_pipeline.config import models
from batch_pipeline.engine.engine_args import engine_kwargs, require_hardware
from batch_pipeline.engine.local import Engines
from batch_pipeline.engine.remote import EngineClient, RemoteEngines, base_url, pooling_routes, warm_routes
from batch_pipeline.engine.placement import plan_ranks
from batch_pipeline.engine.ranks import RankedEngines
from batch_pipeline.base.runtime import configure_runtime_env, gpu_count
from batch_pipeline.engine.vllm_adapter import build_llm, vllm_version
from batch_pipeline.config.model_versions import versioned_name
from batch_pipeline.config.presets import PRESETS
from batch_pipeline.config.settings import (
    ConfigError,
    EngineSettings,
    StorageSettings,
    engine_settings_from_env,
    gpu_run_k8s_config_from_env,
    storage_settings_from_env,
    validation_limits_from_env,
)
from batch_pipeline.io.model_aliases import resolved_pins
from batch_pipeline.steps.validation import ValidationSettings

GPU_POOL = "gpu"


def answering_pool() -> str | None:
    """The Dagster pool of the steps that answer (inference_results, batch_files), chosen when the
    definitions load: "gpu" when a run builds its engine in its own process (dagster.yaml's pool limit:
    one such step per set of GPUs at once); none when every model it can be asked for is on a warm
    engine (ENGINE_URL, and a `url` on each MODELS_FILE entry): the server holds the GPUs and schedules
    every run's requests, so runs answer side by side, bounded by the run queue's limits. A setting
    that cannot be read keeps the pool (the run then says what is wrong)."""
    try:
        settings = engine_settings_from_env()
        warm = bool(settings.engine_url) and all(entry.engine_url for entry in settings.model_registry().values())
    except (ConfigError, OSError, ValueError):
        return GPU_POOL
    return None if warm else GPU_POOL


SLOTLESS_ENGINE = (
    "this run needs an engine in its own process (embeddings, score or rerank lines of a model without "
    "EMBEDDING_ENGINE_URL / SCORE_ENGINE_URL, or a launchpad's engine_url left blank), but with ENGINE_URL set "
    "(and a url on every MODELS_FILE entry) its answering step holds no `gpu` pool slot")
SLOTLESS_FIX = ("Give the pooling model a warm engine of its own (`batch-pipeline engine start --runner pooling`, "
                "EMBEDDING_ENGINE_URL), or run these lines where ENGINE_URL is unset.")


def refuse_slotless_engine() -> None:
    """Refuse to build an engine in this process when the answering step holds no `gpu` slot (every
    model was on a warm engine when the definitions loaded) on a machine with GPUs: it would load a
    model beside the warm engine's, onto devices that engine has already filled. Nor in a Kubernetes
    run pod (GPU_RUN_K8S_CONFIG set): such a run's pod is the launcher's GPU-free one. On other CPU
    machines it is built (memory is the machine's, not a device's)."""
    if answering_pool() is not None:
        return
    if gpu_count() > 0:
        raise ConfigError(f"{SLOTLESS_ENGINE}, and this machine has GPUs: it would load a second model onto "
                          f"devices the warm engine uses. {SLOTLESS_FIX}")
    if gpu_run_k8s_config_from_env():
        raise ConfigError(f"{SLOTLESS_ENGINE}, so its Kubernetes pod is the run launcher's GPU-free one "
                          f"(GPU_RUN_K8S_CONFIG is for runs that load their model). {SLOTLESS_FIX}")


def refuse_gpu_less_pod() -> None:
    """Refuse to load a model in a Kubernetes run pod that has no GPU. With GPU_RUN_K8S_CONFIG set, a
    run that loads its model (answering_pool() "gpu") gets its GPUs from the `dagster-k8s/config` tag
    of batch_job and batch_file_job (defs/jobs.py); a run launched from the asset graph runs under
    Dagster's `__ASSET_JOB`, which carries no job's tags, so its pod is the run launcher's light one.
    (A run on a warm engine is refused by refuse_slotless_engine, with its own reason.)"""
    if answering_pool() is not None and gpu_run_k8s_config_from_env() and gpu_count() == 0:
        raise ConfigError(
            "this run loads its model in its own pod, but the pod has no GPU: with GPU_RUN_K8S_CONFIG set, the GPUs "
            "come with the dagster-k8s/config tag of batch_job and batch_file_job, and this run did not carry it "
            "(runs launched from the asset graph run under Dagster's __ASSET_JOB, which has no job's tags). Launch "
            "it from Jobs > batch_file_job (one file) or batch_job (a date), or set ENGINE_URL to a warm engine.")


BUNDLED_EMBEDDING_NAME = "all-MiniLM-L6-v2"


def _launchpad_fields() -> dict[str, Any]:
    """The `llm` resource's launchpad fields, one per engine setting (config/settings.py): the
    field's name, its type (blank when unset: "" for text, None otherwise) and a description that is
    the variable's name and the setting's `doc`. ENGINE_API_KEY (a secret) is the environment's only;
    ENGINE_ARGS is the JSON text `engine_args`, beside ENGINE_PRESET's `engine_preset`."""
    hints = typing.get_type_hints(EngineSettings)
    made: dict[str, Any] = {}
    for f in dataclasses.fields(EngineSettings):
        var = f.metadata.get("env")
        if var is None or f.metadata["secret"] or f.name == "extra_engine_args":
            continue
        kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        description = f"{var}: {f.metadata['doc']}"  # every setting has its doc (test_settings checks it)
        made[f.name] = (str, Field(default="", description=description)) if kind is str else (
            Optional[kind], Field(default=None, description=description))
    return made


# The engine settings as launchpad fields; a new engine setting appears here by itself.
_EngineSettingFields = create_model("_EngineSettingFields", __base__=dg.ConfigurableResource, **_launchpad_fields())


class LLMResource(_EngineSettingFields):
    """vLLM offline engines: one generation model (chat, completions) and one embedding model. Every
    engine setting is a field (blank: its variable, then its default), made from config/settings.py."""

    engine_preset: str = Field(
        default="",
        description=f"ENGINE_PRESET: engine defaults for a hardware ({', '.join(sorted(PRESETS))}); settings below "
        "still win; blank = none",
    )
    engine_args: str = Field(
        default="", description=f"ENGINE_ARGS: {EngineSettings.__dataclass_fields__['extra_engine_args'].metadata['doc']}"
    )

    _versions: Optional[str] = PrivateAttr(default=None)  # MODEL_VERSIONS as resolved (see _pinned)
    _server: Optional[dict[str, Any]] = PrivateAttr(default=None)  # what the warm engine runs (see _server_model)

    def settings(self) -> EngineSettings:
        """The environment's settings (ENGINE_PRESET first), with what is set here winning."""
        overrides = {k: v for k, v in self.__dict__.items() if k in EngineSettings.__dataclass_fields__}
        if self.engine_args.strip():
            try:
                extra = json.loads(self.engine_args)
                if not isinstance(extra, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                raise ConfigError(f"llm.engine_args={self.engine_args!r} is not a JSON object ({e})") from None
            overrides["extra_engine_args"] = extra
        return self._pinned(engine_settings_from_env(preset_name=self.engine_preset.strip() or None, **overrides))

    def _pinned(self, s: EngineSettings) -> EngineSettings:
        """The settings with every versioned model pinned to one version, resolved once per resource
        (a step): MODEL_VERSIONS first, then the operator's alias, then MODELS_FILE's current."""
        if self._versions is None:
            self._versions = resolved_pins(s, storage_settings_from_env().output_path)
        return s.with_overrides(model_versions=self._versions) if self._versions else s

    # -- names and identity (no model loading) ---------------------------------------------

    def generation_model(self) -> tuple[Optional[str], str]:
        """(model folder or None when the bundled one is not built yet, served name)."""
        s = self.settings()
        if s.model_path:
            path = Path(s.model_path)
            return str(path), s.served_model_name or path.name
        bundled = models.bundled_model_dir()
        return None, s.served_model_name or bundled.name

    def embedding_model(self) -> tuple[Optional[str], Optional[str]]:
        s = self.settings()
        if s.embedding_model_path:
            path = Path(s.embedding_model_path)
            return str(path), s.embedding_served_model_name or path.name
        try:
            path = models.embedding_model_dir()
        except RuntimeError:
            return None, None  # package not installed: /v1/embeddings lines get model_not_found
        return str(path), s.embedding_served_model_name or BUNDLED_EMBEDDING_NAME

    def validation_settings(self) -> ValidationSettings:
        path, served = self.generation_model()
        _, embedding = self.embedding_model()
        s = self.settings()
        score = s.score_model()
        adapters, registry = tuple(s.lora_adapters()), s.model_registry()
        versions = {name: registry[versioned_name(name, v)] for name, v in s.resolved_versions({}).items()}
        # Image parts go only to models that take them (a vision_config; the bundled model does not);
        # LoRA adapters run on the generation model, so they take what it takes.
        takes = [*((served, *adapters) if path and models.takes_images(Path(path)) else ()),
                 *(name for name, m in {**registry, **versions}.items() if models.takes_images(Path(m.model_path)))]
        return ValidationSettings(served_model_name=served, embedding_model_name=embedding,
                                  score_model_name=score[1] if score else None, adapter_names=adapters,
                                  other_models=(*registry, *versions), image_models=tuple(takes), **validation_limits_from_env())

    def identity(self) -> dict[str, Any]:
        """What answers depend on: recorded in batch.json and used to key checkpoints."""
        s = self.settings()
        path, served = self.generation_model()
        path = path or str(models.bundled_model_dir())
        # A warm engine's dtype is its server's: the setting as given (engine_kwargs would import torch).
        dtype = s.dtype if s.engine_url else engine_kwargs(s, path, served, "generate")["dtype"]
        ident = models.model_identity(Path(path)) if Path(path).exists() else {"model_path": path}
        return {
            "model_path": ident.get("model_path", path),
            "model_revision": ident.get("revision", ""),
            "served_model_name": served,
            # Answers of a warm engine and of one in this process are kept apart (their checkpoints).
            "engine": f"vLLM server at {base_url(s.engine_url)}" if s.engine_url else vllm_version(),
            # A warm engine restarted on other weights under the same name starts the answers over.
            **(self._server_model(s, served) if s.engine_url else {}),
            "max_model_len": s.max_model_len or "",
            "dtype": dtype,
            "seed": s.seed,
            **({"reasoning_parser": s.reasoning_parser} if s.reasoning_parser else {}),
            **({"tool_call_parser": s.tool_call_parser} if s.tool_call_parser else {}),
            **({"lora_modules": s.lora_modules} if s.lora_modules else {}),
            **({"models_file": json.dumps({name: {"path": m.model_path, "max_model_len": m.max_model_len, "dtype": m.dtype,
                                                  "seed": m.seed, "reasoning_parser": m.reasoning_parser,
                                                  "tool_call_parser": m.tool_call_parser,
                                                  "lora_modules": m.lora_modules}
                                           for name, m in s.model_registry().items()}, sort_keys=True)}
               if s.models_file else {}),
            **({"model_versions": s.model_versions} if s.model_versions else {}),
        }

    def _server_model(self, s: EngineSettings, served: str) -> dict[str, Any]:
        """What the warm engine says it runs under the served name (vLLM's /v1/models: the weights'
        path it loaded and its context), asked once per resource; empty values where it does not say."""
        if self._server is None:
            client = EngineClient(s.engine_url, s.engine_api_key)
            try:
                card = {str(c["id"]): c for c in client.model_cards()}.get(served, {})
            finally:
                client.close()
            self._server = {"server_model": str(card.get("root") or ""),
                            "server_max_model_len": card.get("max_model_len") or ""}
        return self._server

    # -- engine lifetime ---------------------------------------------------------------------

    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return build_llm(kwargs)

    def owns_engines(self) -> bool:
        return True

    @contextmanager
    def open(self, log: Callable[[str], None], priority: int = 0) -> Iterator["Engines | RankedEngines | RemoteEngines"]:
        """Engines built on first use and always shut down (a leaked engine core hangs the process).
        With DATA_PARALLEL_SIZE > 1, one engine per rank process (engine/ranks.py). With ENGINE_URL
        (or a MODELS_FILE entry's `url`), the warm engines there (engine/remote.py; `priority`: the
        run's, higher sooner), checked before the first request; what none serves is answered in
        this process."""
        s = self.settings()
        path, served = self.generation_model()
        emb_path, emb_name = self.embedding_model()
        engines: Engines | RankedEngines | RemoteEngines
        env = engine_settings_from_env()  # the operator's engines, which ENGINE_API_KEY is for
        typed = [(var, url) for var, url, own in (
                     ("ENGINE_URL", self.engine_url, env.engine_url),
                     ("EMBEDDING_ENGINE_URL", self.embedding_engine_url, env.embedding_engine_url),
                     ("SCORE_ENGINE_URL", self.score_engine_url, env.score_engine_url))
                 if url and base_url(url) != base_url(own)]
        if typed and s.engine_api_key:
            # ENGINE_API_KEY is the operator's, for the engines the environment names: never sent to
            # a URL typed into a run's launchpad config.
            var, url = typed[0]
            log(f"{var} from the launchpad ({base_url(url)}) is not the environment's: ENGINE_API_KEY is not sent to it")
            s = dataclasses.replace(s, engine_api_key="")
        pooling = pooling_routes(s, emb_name)
        if warm_routes(s, served) or pooling:
            configure_runtime_env(models.cache_root(), engine_here=False)  # no torch import for a warm run

            def local() -> Engines:  # only for lines the server does not serve: MODELS_FILE models, pooling
                configure_runtime_env(models.cache_root())
                refuse_slotless_engine()
                refuse_gpu_less_pod()
                require_hardware(s)
                return Engines(s, path or str(models.prepare_bundled_model(log=log)), served, emb_path, emb_name,
                               log=log, builder=self.build_engine, owns=self.owns_engines())

            engines = RemoteEngines(s, served, local, priority=priority, log=log, pooling=pooling)
            try:
                yield engines
            finally:
                engines.close()
            return
        configure_runtime_env(models.cache_root())
        refuse_slotless_engine()
        refuse_gpu_less_pod()
        require_hardware(s)  # e.g. a GPU preset without a GPU: refused before any model is loaded
        if path is None:
            path = str(models.prepare_bundled_model(log=log))
        if s.data_parallel_size > 1:
            plans = plan_ranks(s, gpu_count())
            engines = RankedEngines(s, plans, path, served, emb_path, emb_name, log=log)
        else:
            engines = Engines(s, path, served, emb_path, emb_name, log=log, builder=self.build_engine,
                              owns=self.owns_engines())
        try:
            yield engines
        finally:
            if self.owns_engines():
                engines.close()


class BatchSelection(dg.ConfigurableResource):
    """Which batch files a run covers, set once for all four steps (launchpad: resources > batch);
    blank means every file of the partition's date, as the nightly schedule and backfills run."""

    input_uri: str = Field(
        default="",
        description="A batch file, or a folder/prefix of them; blank = every batch file of the partition's date "
        "(STORAGE_INPUT_PATH/<date>/, plus files at its top uploaded that day)",
    )
    input_uris: list[str] = Field(
        default=[],
        description="Several batch files of the partition's date, answered in one run (one model load); the "
        "upload sensor fills this in for files that arrive together. Each goes to STORAGE_OUTPUT_PATH/<date>/<batch name>/",
    )
    output_uri: str = Field(
        default="",
        description="Result folder for a single input file; blank = STORAGE_OUTPUT_PATH/<date>/<batch name>/",
    )
    shard: str = Field(
        default="",
        description=(
            "i/n: answer only the i-th of n line ranges of each batch (e.g. 2/4), so n runs, on n servers, "
            "share a batch; the last shard to finish writes the results. Blank = the whole batch (or SHARDS "
            "from the upload sensor)"
        ),
    )
    endpoint: str = Field(
        default="",
        description=(
            "Only lines of this url (e.g. /v1/chat/completions; the Batch API's `endpoint`); a line with another "
            "url is a url_mismatch error line. Blank = every supported url"
        ),
    )
    image_column: str = Field(
        default="",
        description=(
            "Parquet/CSV inputs: the column holding each row's image (bytes, an s3:// or https:// URI, a data: URL, "
            "or a path relative to the table's folder; or a list of them), put in the row's user message for a "
            "vision-language model. Blank = TABLE_IMAGE_COLUMN's column in a table that has it, else none"
        ),
    )
    expires_at: int = Field(
        default=0,
        description=(
            "A deadline (Unix time; the Batch API's completion window): requests not answered by then are reported "
            "batch_expired, the answers so far kept, and the batch is expired. 0 = none"
        ),
    )
    skip_completed: bool = Field(
        default=True,
        description=(
            "Leave out batches an earlier run completed from the same file (same ETag) with the same model "
            "and engine settings: their results, batch.json and metrics stay as they are"
        ),
    )


class StorageResource(dg.ConfigurableResource):
    """Where batch files arrive and results go: local folders or s3:// URIs (standard AWS_* variables)."""

    input_path: str = Field(default="", description="STORAGE_INPUT_PATH: folder or s3://bucket/prefix of batch files")
    output_path: str = Field(default="", description="STORAGE_OUTPUT_PATH: folder or s3://bucket/prefix for results")

    def settings(self) -> StorageSettings:
        env = storage_settings_from_env()
        return StorageSettings(input_path=self.input_path or env.input_path, output_path=self.output_path or env.output_path)


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(resources={"llm": LLMResource(), "storage": StorageResource(), "batch": BatchSelection()})

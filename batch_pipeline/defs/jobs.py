"""The batch job: the four batch assets (and their check) for one date, or for one file of it; and
`run_batch`, one file's run of it in this process (`batch-pipeline run`, `batch-pipeline model verify`)."""

import json
import os
from typing import Any

import dagster as dg

from batch_pipeline.config.settings import (
    ConfigError,
    dagster_home_from_env,
    engine_settings_from_env,
    gpu_run_k8s_config_from_env,
    storage_settings_from_env,
)
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.resources import answering_pool
from batch_pipeline.defs.run_watch import WARM_ENGINE_TAG
from batch_pipeline.engine.remote import base_url
from batch_pipeline.io.model_aliases import resolved_pins
from batch_pipeline.io.storage import StorageError

# Dagster's K8sRunLauncher (deploy/helm) reads a run's own pod config from this tag and merges it deep
# onto the launcher's runK8sConfig and the code server's container context: dicts key by key, a
# value given here replacing the launcher's, lists appended (dagster-k8s 0.29.27,
# K8sContainerContext._merge_k8s_config). It can add a GPU but never take one away, so the
# launcher's pod is the GPU-free one of a run on a warm engine, and this tag makes a run that loads
# its model a GPU pod. Other run launchers (compose's, `dagster dev`'s) ignore it.
K8S_CONFIG_TAG = "dagster-k8s/config"
GPU_RESOURCE = "nvidia.com/gpu"


def run_pod_tags() -> dict[str, str]:
    """The `dagster-k8s/config` tag of a run that loads its model in its own pod (answering_pool()
    "gpu"): GPU_RUN_K8S_CONFIG (the GPU nodes' selector and tolerations, CPUs and memory) with
    nvidia.com/gpu = DATA_PARALLEL_SIZE x TENSOR_PARALLEL_SIZE, the GPUs its rank plan takes. No
    tag for a run on a warm engine (the launcher's GPU-free pod), nor without GPU_RUN_K8S_CONFIG (no
    Kubernetes pod to size). Read when the definitions load, as answering_pool() is; a bad
    GPU_RUN_K8S_CONFIG fails them, naming it."""
    config = gpu_run_k8s_config_from_env()
    if not config or answering_pool() is None:
        return {}
    try:
        settings = engine_settings_from_env()
    except ConfigError:  # left as written: the run says what is wrong with the setting when it starts
        pass
    else:
        limits = config.setdefault("container_config", {}).setdefault("resources", {}).setdefault("limits", {})
        limits[GPU_RESOURCE] = str(settings.data_parallel_size * settings.tensor_parallel_size)
    return {K8S_CONFIG_TAG: json.dumps(config, sort_keys=True)}


# Every file run names the engine its answers go to: the run queue's limit per engine counts it
# (dagster.yaml's tag_concurrency_limits), so one engine's runs cannot take every run slot.
ENGINE_TAG = "batch_pipeline/engine"
IN_PROCESS = "in-process"


def engine_tag() -> str:
    """The engine a run started now answers on: ENGINE_URL (a warm engine), else "in-process"."""
    try:
        return engine_settings_from_env().engine_url or IN_PROCESS
    except ConfigError:
        return IN_PROCESS  # the run says what is wrong with the setting when it starts


def warm_engine_tags() -> dict[str, str]:
    """{WARM_ENGINE_TAG: ENGINE_URL's server} when a warm engine answers the runs, else nothing: the
    runs answering there see an urgent run coming from its start (defs/run_watch.py)."""
    url = engine_tag()
    return {} if url == IN_PROCESS else {WARM_ENGINE_TAG: base_url(url)}


# Read once when the definitions load, as answering_pool() is; both jobs answer, so both carry them.
RUN_POD_TAGS = {**run_pod_tags(), **warm_engine_tags()}

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*BATCH_ASSETS),
    tags=RUN_POD_TAGS,
    description="Validate, infer, write and measure the batch files of one date (or the one file in the run config).",
)

batch_file_job = dg.define_asset_job(
    "batch_file_job",
    selection=dg.AssetSelection.assets(batch_files),
    tags={ENGINE_TAG: engine_tag(), **RUN_POD_TAGS},  # read when the definitions load, as answering_pool() is
    description="One batch file (a batch_files partition, <date>/<name>): validate, infer, write, measure. The "
                "upload sensor, the nightly schedule and backfills from this job run one of these per file.",
)


def model_versions_now() -> str:
    """MODELS_FILE's versioned models pinned to the versions their aliases name now ("name=v ..."), or
    "" (no versioned models, or a models file that cannot be read: the run then says why when it starts)."""
    settings = engine_settings_from_env()
    try:
        return resolved_pins(settings, storage_settings_from_env().output_path)
    except (ConfigError, OSError, StorageError):
        return ""


def batch_run_config(input_uri: str = "", output_uri: str = "", shard: str = "", skip_completed: bool = True,
                     input_uris: list[str] | None = None, endpoint: str = "", expires_at: int = 0,
                     model_versions: str | None = None) -> dict[str, Any]:
    """Run config of one run's batch selection (the `batch` resource every step reads): one input
    file/folder and one output folder, or several files of the date (`input_uris`), optionally one
    line range (`shard` "i/n") of each batch. All blank: every file of the partition's date.
    `endpoint` and `expires_at`: only lines of that url, and a deadline (the Batch API's).
    `model_versions`: the versions the run answers with ("name=v ..."); None: MODELS_FILE's versioned
    models as their aliases name them now, so a run keeps the versions of when it was requested (the
    schedule's and sensor's ticks) even if it starts after a switch; "": resolved when it starts."""
    if model_versions is None:
        model_versions = model_versions_now()
    config: dict[str, Any] = {"input_uri": input_uri, "output_uri": output_uri}
    if input_uris:
        config["input_uris"] = list(input_uris)
    if shard:
        config["shard"] = shard
    if not skip_completed:
        config["skip_completed"] = False
    if endpoint:
        config["endpoint"] = endpoint
    if expires_at:
        config["expires_at"] = int(expires_at)
    resources: dict[str, Any] = {"batch": {"config": config}}
    if model_versions:
        resources["llm"] = {"config": {"model_versions": model_versions}}
    return {"resources": resources}


def _instance() -> Any:
    """DAGSTER_HOME's instance (Dagster's own variable), else a throwaway one."""
    home = dagster_home_from_env()
    if home:
        os.makedirs(home, exist_ok=True)  # a new home is fine: Dagster's defaults (SQLite) apply
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()


def run_batch(input_uri: str, output_dir: str, partition: str, resources: dict[str, Any] | None = None,
              instance: Any = None, log_level: str = "INFO", shard: str = "", image_column: str = "") -> Any:
    """Run `batch_job` for one input file in-process; returns Dagster's result. The run is listed in
    the instance's Runs as `batch_job`, tagged with its source, input and batch name. `image_column`:
    a Parquet/CSV input's column of images (the run config's batch.image_column)."""
    from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
    from batch_pipeline.io.locations import batch_name

    run_config = {
        **batch_run_config(input_uri, output_dir, shard=shard),
        "loggers": {"console": {"config": {"log_level": log_level}}},
    }
    if image_column:
        run_config["resources"]["batch"]["config"]["image_column"] = image_column
    resources = {"batch": BatchSelection(), **(resources or {"llm": LLMResource(), "storage": StorageResource()})}
    job = dg.Definitions(assets=BATCH_ASSETS, jobs=[batch_job], resources=resources).resolve_job_def("batch_job")
    tags = {"batch_pipeline/source": "cli", "batch_pipeline/input_uri": input_uri,
            "batch_pipeline/batch_name": batch_name(input_uri), "batch_pipeline/output_uri": output_dir}
    if shard:
        tags["batch_pipeline/shard"] = shard
    return job.execute_in_process(
        run_config=run_config,
        partition_key=partition,
        instance=instance if instance is not None else _instance(),
        raise_on_error=False,
        tags=tags,
    )

"""The batch job: the four batch assets (and their check) for one date, or for one file of it."""

from typing import Any

import dagster as dg

from batch_pipeline.config.settings import ConfigError, engine_settings_from_env, storage_settings_from_env
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.io.model_aliases import resolved_pins
from batch_pipeline.io.storage import StorageError

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*BATCH_ASSETS),
    description="Validate, infer, write and measure the batch files of one date (or the one file in the run config).",
)

batch_file_job = dg.define_asset_job(
    "batch_file_job",
    selection=dg.AssetSelection.assets(batch_files),
    description="Re-run one batch file (a batch_files partition, <date>/<name>) alone: validate, infer, write, measure.",
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

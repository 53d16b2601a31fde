"""The batch job: the four batch assets (and their check) for one date, or for one file of it."""

from typing import Any

import dagster as dg

from batch_pipeline.defs.assets import BATCH_ASSETS

batch_job = dg.define_asset_job(
    "batch_job",
    selection=dg.AssetSelection.assets(*BATCH_ASSETS),
    description="Validate, infer, write and measure the batch files of one date (or the one file in the run config).",
)


def batch_run_config(input_uri: str = "", output_uri: str = "", shard: str = "") -> dict[str, Any]:
    """Run config that points every batch asset at one input file/folder and one output folder
    (and, with `shard` "i/n", at one line range of each batch)."""
    config = {"input_uri": input_uri, "output_uri": output_uri, **({"shard": shard} if shard else {})}
    return {"ops": {asset.key.to_user_string(): {"config": config} for asset in BATCH_ASSETS}}

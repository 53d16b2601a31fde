"""The Dagster entry point (workspace.yaml): every definition under batch_pipeline/defs/."""

import dagster as dg

import batch_pipeline.defs


@dg.definitions
def defs() -> dg.Definitions:
    # load_defs works from an installed (non-editable) package too, e.g. in the container image.
    return dg.load_defs(defs_root=batch_pipeline.defs)

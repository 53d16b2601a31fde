"""The Dagster entry point (workspace.yaml): every definition under batch_pipeline/defs/."""

import dagster as dg

import batch_pipeline.defs


@dg.definitions
def defs() -> dg.Definitions:
    # load_defs works from an installed (non-editable) package too, e.g. in the container image.
    # In-process executor: the four steps are a straight line, and a process per step cost ~4-5 s
    # each (an empty date took 34 s with the multiprocess executor, 1 s in-process). Pools still apply.
    return dg.Definitions.merge(
        dg.load_defs(defs_root=batch_pipeline.defs),
        dg.Definitions(executor=dg.in_process_executor),
    )

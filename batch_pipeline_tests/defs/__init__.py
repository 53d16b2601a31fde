"""Tests of batch_pipeline/defs/: the Dagster assets, jobs, sensors, schedules and run watch."""

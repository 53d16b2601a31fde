"""Dagster wiring only: every module here is loaded by `batch_pipeline.definitions`."""

"""Tests of batch_pipeline/steps/: validation and the planned order of lines."""

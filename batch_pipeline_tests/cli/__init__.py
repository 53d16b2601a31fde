"""Tests of the command line, batch_pipeline/cli/: `batch-pipeline` (main.py), its doctor and its model-version commands."""

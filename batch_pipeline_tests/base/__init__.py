"""Tests of batch_pipeline/base/: the process runtime, errors and settings readers."""

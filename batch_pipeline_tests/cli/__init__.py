"""Tests of the entry points at the top of batch_pipeline/: cli.py, doctor.py, model_commands.py."""

"""Tests of batch_pipeline/config/: settings, the model registry and MODELS_FILE."""

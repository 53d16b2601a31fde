"""Tests of batch_pipeline/io/: storage (local and S3), checkpoints, tables and images."""

"""Tests of batch_pipeline/service/: the Batch API, its metrics and alerting rules."""

"""Tests of batch_pipeline/contract/: what a batch line may say and what it is answered with."""

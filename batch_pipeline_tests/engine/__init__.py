"""Tests of batch_pipeline/engine/: vLLM behind the adapter, in-process, in ranks and as a warm server."""

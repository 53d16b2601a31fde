"""Where batches are read and written: storage (local or S3), locations, checkpoints, tables, uploads,
notifications, images, shards. Imports base/, config/ and contract/; no vLLM, no Dagster."""

"""Configuration: settings by the names users know (MODEL_PATH, BATCH_SIZE, ...), engine presets, the
model registry. Imports base/ only."""

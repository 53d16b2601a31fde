"""The bottom layer, imported by every other: configuration errors, deterministic ids, progress logging,
the process runtime (environment, hardware, exit). Imports nothing of batch_pipeline."""

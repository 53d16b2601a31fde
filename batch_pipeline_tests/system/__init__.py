"""Whole-system tests that span every layer: docs, deploy manifests, dagster dev end to end, the UI."""

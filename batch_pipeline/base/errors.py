"""The error every configuration check raises, and the cancel the answering loop raises, in a module of
their own so that any module can raise them (presets, settings, engine arguments, steps) without
importing the others."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


class CancelRequested(KeyboardInterrupt):
    """The run was cancelled and the answering loop saw it (defs/run_watch.py) rather than an interrupt:
    a KeyboardInterrupt, so everything that handles Ctrl-C or Dagster's terminate handles it alike."""


__all__ = ["CancelRequested", "ConfigError"]

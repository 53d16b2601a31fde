"""The error every configuration check raises, in a module of its own so that any module can raise it
(presets, settings, engine arguments) without importing the others."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


__all__ = ["ConfigError"]

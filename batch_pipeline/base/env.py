"""Settings read from environment variables: one parser, one wording of its errors.

Every settings function reads through these, so a bad value fails the same way whatever reads it: a
ConfigError naming the variable, the value given and what it should be (`BATCH_SIZE='two' is not a
valid integer`, `SENSOR_WINDOW_DAYS='0' is out of range (1 to 3660 days, or 'all')`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from batch_pipeline.base.errors import ConfigError

_KINDS = {"int": "integer", "float": "number", "bool": "boolean (true/false)", "dict[str, Any]": "JSON object"}


def coerce(name: str, raw: str, target: Any) -> Any:
    """`raw` as `target` (int, float, bool, a JSON object, or their dataclass annotation strings);
    ConfigError naming `name` when it is not one. Other targets get `raw` unchanged."""
    try:
        if target in (int, "int", "int | None"):
            return int(raw)
        if target in (float, "float", "float | None"):
            return float(raw)
        if target in (bool, "bool", "bool | None"):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if target == "dict[str, Any]":
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
    except ValueError as e:
        kind = str(getattr(target, "__name__", target)).replace(" | None", "")
        raise ConfigError(f"{name}={raw!r} is not a valid {_KINDS.get(kind, kind)}") from e
    return raw


def int_in_range(env: Mapping[str, str], name: str, low: int, high: int, note: str = "") -> int | None:
    """The integer variable `name`, or None when unset; ConfigError naming it when out of range."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    value = coerce(name, raw, int)
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} is out of range ({low} to {high}{note})")
    return value


def number_in_range(env: Mapping[str, str], name: str, low: float, high: float, note: str = "",
                    above_low: bool = False) -> float | None:
    """The number variable `name`, or None when unset; ConfigError naming it when out of range
    (`above_low`: `low` itself is out, e.g. a timeout above 0)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    value = coerce(name, raw, float)
    if not (low < value if above_low else low <= value) or not value <= high:
        bound = f"above {low:g}" if above_low else f"{low:g}"
        raise ConfigError(f"{name}={raw!r} is out of range ({bound} to {high:g}{note})")
    return value

"""Settings read from environment variables: the one way in, one parser, one wording of its errors.

Every setting is read through these readers (`read_text`, `read_choice`, `read_checked`,
`int_in_range`, `number_in_range`; `environ` for a table of names), each variable by one settings
function; this module is the only one that reads `os.environ` for a setting (test_docs.py checks it).
A bad value fails the same way whatever reads it: a ConfigError naming the variable, the value given
and what it should be (`BATCH_SIZE='two' is not a valid integer`, `SENSOR_WINDOW_DAYS='0' is out of
range (1 to 3660 days, or 'all')`, `SENSOR_BACKLOG='later' is not one of run, skip`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
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


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """The environment settings are read from: `env` where a caller or a test gives one, else the
    process's. The one read of `os.environ` for a setting."""
    return os.environ if env is None else env


def read_text(env: Mapping[str, str] | None, name: str, default: str = "") -> str:
    """The variable `name`, stripped; `default` when unset or blank."""
    return environ(env).get(name, "").strip() or default


def read_choice(env: Mapping[str, str] | None, name: str, options: tuple[str, ...], default: str,
                lower: bool = True) -> str:
    """The variable `name`, one of `options` (lower-cased first unless `lower` is False); `default`
    when unset; ConfigError naming it otherwise."""
    raw = read_text(env, name)
    if not raw:
        return default
    value = raw.lower() if lower else raw
    if value not in options:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(options)}")
    return value


def read_checked(env: Mapping[str, str] | None, name: str, ok: Callable[[str], bool], what: str,
                 default: str = "", secret: bool = False) -> str:
    """The variable `name` when `ok` takes it; `default` when unset; ConfigError naming it and
    saying what it should be (`what`, e.g. "an http:// or https:// URL") otherwise. `secret`: the
    value is not repeated in the error (it may hold a token)."""
    raw = read_text(env, name)
    if not raw:
        return default
    if not ok(raw):
        raise ConfigError(f"{name} is not {what}" if secret else f"{name}={raw!r} is not {what}")
    return raw


def check_range(name: str, value: float, low: float, high: float | None = None, note: str = "",
                above_low: bool = False, shown: Any = None) -> None:
    """ConfigError naming `name` and the value given (`shown`, else `value`) when `value` is not
    between `low` and `high` (None: no upper bound; `above_low`: `low` itself is out). The one
    wording of a range error, for a variable read here and for a field set in the launchpad."""
    if (low < value if above_low else low <= value) and (high is None or value <= high):
        return

    def show(bound: float) -> str:
        return str(bound) if isinstance(bound, int) else f"{bound:g}"

    if high is None:
        bounds = f"above {show(low)}" if above_low else f"at least {show(low)}"
    else:
        bounds = f"{'above ' if above_low else ''}{show(low)} to {show(high)}"
    raise ConfigError(f"{name}={value if shown is None else shown!r} is out of range ({bounds}{note})")


def int_in_range(env: Mapping[str, str] | None, name: str, low: int, high: int | None = None,
                 note: str = "") -> int | None:
    """The integer variable `name`, or None when unset; ConfigError naming it when out of range
    (`high` None: at least `low`)."""
    raw = read_text(env, name)
    if not raw:
        return None
    value = coerce(name, raw, int)
    check_range(name, value, low, high, note, shown=raw)
    return value


def number_in_range(env: Mapping[str, str] | None, name: str, low: float, high: float | None = None,
                    note: str = "", above_low: bool = False) -> float | None:
    """The number variable `name`, or None when unset; ConfigError naming it when out of range
    (`above_low`: `low` itself is out, e.g. a timeout above 0; nan is never in range)."""
    raw = read_text(env, name)
    if not raw:
        return None
    value = coerce(name, raw, float)
    check_range(name, value, low, high, note, above_low, shown=raw)
    return value

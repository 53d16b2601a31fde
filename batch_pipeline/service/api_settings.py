"""The Batch API's settings from the environment: keys, limits, priority caps, windows, expiry.

Each function reads one family of BATCH_API_* variables and fails with a ConfigError naming the
variable, so `batch-pipeline serve` refuses to start on a bad value instead of serving with it.
Per-tenant lists (`team-a:2,team-b:none`) go through one parser, `tenant_values`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from batch_pipeline.base.env import check_range, coerce, int_in_range, read_text
from batch_pipeline.config.priority import PRIORITY_BOUND
from batch_pipeline.config.settings import ConfigError

V = TypeVar("V")

# A priority is a whole number within +-PRIORITY_BOUND; each tenant's highest is capped by the operator
# (BATCH_API_MAX_PRIORITY, default 0).
PRIORITY_KEY = "priority"
# OpenAI's only completion window; an operator may allow others (BATCH_API_COMPLETION_WINDOWS).
COMPLETION_WINDOWS = {"24h": 24 * 3600}
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# OpenAI's limits for a batch input file (BATCH_API_MAX_FILE_BYTES / _REQUESTS change them).
MAX_FILE_BYTES = 200 * 2**20
MAX_FILE_REQUESTS = 50_000
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# OpenAI's range for files' `expires_after` and batches' `output_expires_after` (1 hour to 30 days).
MIN_EXPIRY_SECONDS, MAX_EXPIRY_SECONDS = 3600, 30 * 24 * 3600
DEFAULT_DAGSTER_URL = "http://127.0.0.1:3000"


def load_keys(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{key: tenant} from BATCH_API_KEYS and BATCH_API_KEYS_FILE; ConfigError naming the variable."""
    entries: list[tuple[str, str]] = []
    for item in read_text(env, "BATCH_API_KEYS").split(","):
        if item.strip():
            entries.append(("BATCH_API_KEYS", item.strip()))
    path = read_text(env, "BATCH_API_KEYS_FILE")
    if path:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise ConfigError(f"BATCH_API_KEYS_FILE={path} cannot be read: {e}") from None
        entries += [("BATCH_API_KEYS_FILE", line.strip()) for line in lines if line.strip() and not line.startswith("#")]
    keys: dict[str, str] = {}
    for source, item in entries:
        tenant, sep, key = item.partition(":")
        if not sep or not tenant.strip() or len(key.strip()) < 8:
            raise ConfigError(f"{source}: an entry is not tenant:key with a key of 8 characters or more")
        keys[key.strip()] = tenant.strip()
    if not keys:
        raise ConfigError("no API keys: set BATCH_API_KEYS (tenant:key pairs, comma-separated) or BATCH_API_KEYS_FILE")
    return keys


def completion_windows(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """{window: seconds} a batch may ask for: OpenAI's "24h", plus the durations an operator allows
    in BATCH_API_COMPLETION_WINDOWS (comma-separated, e.g. "1h,48h,7d"; an extension of OpenAI's API)."""
    windows = dict(COMPLETION_WINDOWS)
    for name in (w.strip() for w in read_text(env, "BATCH_API_COMPLETION_WINDOWS").split(",")):
        if not name:
            continue
        match = re.fullmatch(r"([1-9][0-9]*)([smhd])", name)
        if match is None:
            raise ConfigError(f"BATCH_API_COMPLETION_WINDOWS: {name!r} is not a duration such as 90s, 30m, 48h or 7d")
        windows[name] = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return windows


def tenant_values(raw: str, name: str, tenants: set[str], parse: Callable[[str, str], V], word: str,
                  example: str) -> dict[str, V]:
    """{tenant: value} from a `tenant:value` list (comma-separated) read from variable `name`; each value
    through `parse(value, label)`. ConfigError naming the variable for an entry that is not
    tenant:`word` (`example` shows a list) or a tenant without an API key."""
    values: dict[str, V] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        tenant, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or not tenant:
            raise ConfigError(f"{name}: {item.strip()!r} is not tenant:{word} (e.g. {example})")
        if tenant not in tenants:
            raise ConfigError(f"{name}: tenant {tenant!r} has no API key (BATCH_API_KEYS)")
        values[tenant] = parse(value, f"{name} ({tenant})")
    return values


def load_limits(tenants: set[str], env: Mapping[str, str] | None = None) -> tuple[int | None, dict[str, int | None]]:
    """Batches in flight per tenant: (BATCH_API_MAX_IN_FLIGHT, {tenant: limit} from
    BATCH_API_TENANT_LIMITS, `none` for no limit); ConfigError naming the variable."""
    default = positive(read_text(env, "BATCH_API_MAX_IN_FLIGHT"), "BATCH_API_MAX_IN_FLIGHT")
    overrides = tenant_values(read_text(env, "BATCH_API_TENANT_LIMITS"), "BATCH_API_TENANT_LIMITS", tenants,
                              lambda value, label: None if value.lower() == "none" else positive(value, label),
                              "limit", "team-a:2,team-b:none")
    return default, overrides


def load_priority_caps(tenants: set[str], env: Mapping[str, str] | None = None) -> tuple[int, dict[str, int]]:
    """The highest `metadata["priority"]` a tenant may give: (BATCH_API_MAX_PRIORITY, default 0, for
    every tenant; {tenant: cap} from BATCH_API_TENANT_MAX_PRIORITY, `team-a:10,team-b:0`);
    ConfigError naming the variable."""
    default = priority_cap(read_text(env, "BATCH_API_MAX_PRIORITY"), "BATCH_API_MAX_PRIORITY")
    overrides = tenant_values(read_text(env, "BATCH_API_TENANT_MAX_PRIORITY"), "BATCH_API_TENANT_MAX_PRIORITY", tenants,
                              priority_cap, "cap", "team-a:10,team-b:0")
    return default, overrides


def min_expiry_seconds(env: Mapping[str, str] | None = None) -> int:
    """BATCH_API_MIN_EXPIRY_SECONDS: the shortest expiry accepted (OpenAI's 3600 unless lowered)."""
    value = int_in_range(env, "BATCH_API_MIN_EXPIRY_SECONDS", 1, MAX_EXPIRY_SECONDS, " seconds, the longest expiry")
    return MIN_EXPIRY_SECONDS if value is None else value


def file_limits(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(bytes, requests) an uploaded file may hold: BATCH_API_MAX_FILE_BYTES and
    BATCH_API_MAX_FILE_REQUESTS, OpenAI's limits by default."""
    max_bytes = int_in_range(env, "BATCH_API_MAX_FILE_BYTES", 1)
    max_requests = int_in_range(env, "BATCH_API_MAX_FILE_REQUESTS", 1)
    return max_bytes or MAX_FILE_BYTES, max_requests or MAX_FILE_REQUESTS


def dagster_url(env: Mapping[str, str] | None = None) -> str:
    """DAGSTER_WEBSERVER_URL: the Dagster web server the runs are submitted to."""
    return read_text(env, "DAGSTER_WEBSERVER_URL", DEFAULT_DAGSTER_URL)


def positive(value: str, name: str) -> int | None:
    """A whole number of 1 or more, None when empty; ConfigError naming `name` otherwise (base/env.py's
    wording: a tenant's value in a list is checked as a variable is)."""
    if not value.strip():
        return None
    number = coerce(name, value.strip(), int)
    check_range(name, number, 1, shown=value.strip())
    return number


def priority_cap(value: str, name: str) -> int:
    """A tenant's highest priority: 0 to PRIORITY_BOUND, 0 when empty; ConfigError naming `name`."""
    if not value.strip():
        return 0
    number = coerce(name, value.strip(), int)
    check_range(name, number, 0, PRIORITY_BOUND, shown=value.strip())
    return number

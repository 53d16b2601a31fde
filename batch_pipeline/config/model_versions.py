"""Versions of a MODELS_FILE model: `name@version` entries, their weight checksums, and which version
an unversioned `body.model` means.

A MODELS_FILE entry with `versions` serves every version under `name@version` (the folder of each,
its own settings on top of the entry's shared ones, and optionally `sha256: {file: checksum}` of its
weight files). Plain `name` means the model's current version: the alias an operator switches with
`batch-pipeline model use` and `model rollback` (io/model_aliases.py), else the entry's `current`,
else its last listed version. A run resolves the alias once, when it is requested (the Batch API at
create, the schedule and sensor at their tick) or when it starts, and keeps that version to the end.

Checksums are verified before a version is loaded: a file that changed, is truncated or is missing
is refused, naming the file. A file whose size and modification time match a checksum verified
earlier on this machine is not read again (a record in the cache folder); `model verify` always reads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batch_pipeline.base.errors import ConfigError
from batch_pipeline.config.models import WEIGHT_SUFFIXES, cache_root, sha256

VERSION_SEP = "@"
VERSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
VERIFIED_RECORD = "verified-weights.json"  # in the cache folder: checksums already read on this machine


@dataclass(frozen=True)
class ModelVersions:
    """One versioned MODELS_FILE model: its versions in file order and the version the file calls current."""

    name: str
    versions: tuple[str, ...]
    current: str  # `current:` in the file, else the last listed version
    checksums: dict[str, dict[str, str]] = field(default_factory=dict)  # version -> {file: sha256}

    def served(self, version: str) -> str:
        return versioned_name(self.name, version)


def versioned_name(name: str, version: str) -> str:
    return f"{name}{VERSION_SEP}{version}"


def split_versioned(text: str) -> tuple[str, str]:
    """'name@version' -> (name, version); 'name' -> (name, '')."""
    name, _, version = text.partition(VERSION_SEP)
    return name, version


def check_version_name(where: str, name: str, version: object) -> str:
    text = str(version)
    if not VERSION_NAME.match(text):
        raise ConfigError(f"{where}: model {name!r} has a version {text!r}: a version is 1-64 letters, digits, '.', "
                          "'_' or '-', starting with a letter or digit")
    return text


def parse_pins(text: str, where: str = "MODEL_VERSIONS") -> dict[str, str]:
    """'a=v1 b=v2' (or commas) -> {'a': 'v1', 'b': 'v2'}: the versions a run is pinned to."""
    pins: dict[str, str] = {}
    for item in text.replace(",", " ").split():
        name, sep, version = item.partition("=")
        if not sep or not name.strip() or not version.strip():
            raise ConfigError(f"{where}={text!r}: {item!r} is not name=version")
        pins[name.strip()] = version.strip()
    return pins


def format_pins(pins: dict[str, str]) -> str:
    return " ".join(f"{name}={version}" for name, version in sorted(pins.items()))


def resolve(versioned: dict[str, ModelVersions], aliases: dict[str, str], pins: dict[str, str],
            where: str = "MODEL_VERSIONS") -> dict[str, str]:
    """{model: version} for every versioned model: a pin first, then the alias, then the file's current.
    A pin naming an unknown model or version is refused (a run must not silently answer with another);
    an alias whose version left the file falls back to the file's current."""
    for name, version in pins.items():
        if name not in versioned:
            raise ConfigError(f"{where}: {name!r} is not a versioned model of MODELS_FILE "
                              f"(versioned: {', '.join(sorted(versioned)) or 'none'})")
        if version not in versioned[name].versions:
            raise ConfigError(f"{where}: {name!r} has no version {version!r} "
                              f"(versions: {', '.join(versioned[name].versions)})")
    chosen = {}
    for name, model in versioned.items():
        alias = aliases.get(name, "")
        chosen[name] = pins.get(name) or (alias if alias in model.versions else model.current)
    return chosen


# ------------------------------------------------------------------------------- checksums


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder (what `model checksum` records), sorted by name."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def checksums_of(folder: Path, log: Callable[[str], None] = lambda _m: None) -> dict[str, str]:
    """{relative path: sha256} of a folder's weight files."""
    files = weight_files(folder)
    if not files:
        raise ConfigError(f"{folder}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) to take checksums of")
    out = {}
    for path in files:
        log(f"sha256 {path.relative_to(folder)} ({path.stat().st_size / 2**20:.0f} MiB)")
        out[str(path.relative_to(folder))] = sha256(path)
    return out


def verify_checksums(label: str, folder: Path, expected: dict[str, str], *, reread: bool = False,
                     log: Callable[[str], None] = lambda _m: None) -> int:
    """Refuse a folder whose listed files are missing, changed or truncated, naming the file; returns how
    many files were read (the rest matched a checksum verified earlier on this machine, by size and
    modification time; `reread` reads every file)."""
    record_path = cache_root() / VERIFIED_RECORD
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    read = 0
    for relative, want in sorted(expected.items()):
        path = folder / relative
        where = f"{label}: weight file {path}"
        try:
            st = path.stat()
        except OSError:
            raise ConfigError(f"{where} is missing; refusing to load this version") from None
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if not reread and record.get(key) == want:
            continue
        log(f"{label}: checking {relative} ({st.st_size / 2**20:.0f} MiB)")
        got = sha256(path)
        read += 1
        if got != want:
            raise ConfigError(f"{where} does not match its checksum in MODELS_FILE (sha256 {got[:16]}..., "
                              f"expected {want[:16]}...; {st.st_size} bytes): changed or truncated, "
                              "refusing to load this version")
        record[key] = want
    if read:
        tmp = record_path.with_name(f".{VERIFIED_RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, record_path)
    return read

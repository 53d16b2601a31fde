"""Which version of a versioned model new work uses: the alias an operator switches and rolls back.

One JSON document, `STORAGE_OUTPUT_PATH/_models/aliases.json` (a folder or S3, beside the Batch
API's records, so every API replica, schedule, sensor and run worker reads the same):

    {"summarizer": {"version": "v2", "stack": ["v1", "v2"],
                    "history": [{"version": "v2", "at": 1764790000, "by": "alice", "action": "use"}]}}

A switch changes only what is resolved afterwards: a Batch API batch takes its versions at create,
a scheduled or sensor run at its tick, a run launched by hand when it starts; each keeps them to the
end (config/model_versions.py). `rollback` goes back to the version before the current one.
"""

from __future__ import annotations

import getpass
import time
from typing import Any

from batch_pipeline.base.errors import ConfigError
from batch_pipeline.config.model_versions import ModelVersions, format_pins, resolve
from batch_pipeline.config.settings import EngineSettings
from batch_pipeline.io import storage

FOLDER = "_models"
DOCUMENT = "aliases.json"
HISTORY_KEPT = 100  # switches remembered per model


def aliases_uri(output_root: str) -> str:
    return storage.join(output_root, FOLDER, DOCUMENT)


def read_document(output_root: str) -> dict[str, Any]:
    uri = aliases_uri(output_root)
    if not storage.exists(uri):
        return {}
    data = storage.read_json(uri)
    if not isinstance(data, dict):
        raise ConfigError(f"{uri} is not a JSON object of model -> {{version, history}}")
    return data


def read_aliases(output_root: str) -> dict[str, str]:
    """{model: version} as switched by an operator (models never switched are absent)."""
    return {name: str(entry.get("version", "")) for name, entry in read_document(output_root).items()
            if isinstance(entry, dict) and entry.get("version")}


def resolved_pins(settings: EngineSettings, output_root: str) -> str:
    """MODELS_FILE's versioned models, each pinned to one version ("name=v ..."): MODEL_VERSIONS first,
    then the alias kept under `output_root`, then the file's `current`; "" without versioned models.
    The one resolution of the Batch API's create, the schedule's and sensor's ticks and a run's start.
    Raises what reading them raises (ConfigError, StorageError)."""
    versioned = settings.versioned_models()
    if not versioned:
        return ""
    pins = settings.pinned_versions()
    aliases = {} if set(versioned) <= set(pins) else read_aliases(output_root)  # all pinned: no read
    return format_pins(resolve(versioned, aliases, pins))


def switch(output_root: str, model: ModelVersions, version: str, action: str = "use", by: str = "") -> dict[str, Any]:
    """Point `model`'s alias at `version` (one of its versions); returns the model's new entry."""
    if version not in model.versions:
        raise ConfigError(f"{model.name!r} has no version {version!r} (versions: {', '.join(model.versions)})")
    document = read_document(output_root)
    entry = document.get(model.name) if isinstance(document.get(model.name), dict) else {}
    # `stack`: the versions switched to, oldest first; a rollback pops the top (the first switch
    # starts it with what the alias meant before: MODELS_FILE's current).
    stack = [v for v in entry.get("stack", [model.current]) if v in model.versions] or [model.current]
    if action == "rollback":
        stack.pop()
    elif stack[-1] != version:
        stack.append(version)
    history = list(entry.get("history", []))
    history.append({"version": version, "at": int(time.time()), "by": by or _user(), "action": action})
    entry = {"version": version, "stack": stack[-HISTORY_KEPT:], "history": history[-HISTORY_KEPT:]}
    document[model.name] = entry
    storage.write_json(aliases_uri(output_root), document)
    return entry


def rollback(output_root: str, model: ModelVersions, by: str = "") -> tuple[str, str]:
    """Switch back to the version in use before the current one: (from, to). Rolling back twice goes
    two switches back; a rollback never goes past MODELS_FILE's `current`."""
    entry = read_document(output_root).get(model.name) or {}
    stack = [v for v in entry.get("stack", []) if v in model.versions]
    current = entry.get("version") if entry.get("version") in model.versions else model.current
    if len(stack) < 2:
        raise ConfigError(f"{model.name!r} has no earlier version to roll back to (it is on {current!r} and was "
                          "not switched from another; `batch-pipeline model use NAME@VERSION` picks any version)")
    switch(output_root, model, stack[-2], action="rollback", by=by)
    return current, stack[-2]


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return ""

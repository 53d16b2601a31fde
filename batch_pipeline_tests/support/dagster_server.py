"""A real `dagster dev` (web server + daemon + code server) for end-to-end tests, and ways to drive it.

`start_dagster_dev(home, env)` copies the repo's dagster.yaml into a fresh DAGSTER_HOME, marks the
UI's "join the community" modal as seen, starts `dagster dev -w workspace.yaml` on 127.0.0.1 and a
free port, and returns once the code location is loaded and the daemons report healthy. Stop it
with `.stop()`, which ends the whole process group: web server, daemon, code server and any run
worker the daemon launched.

Started from a background job, `dagster dev` inherits SIGINT/SIGTERM as ignored and then only
SIGKILL stops it; a tiny wrapper restores the default handlers before exec'ing it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batch_pipeline_tests.support import REPO, TEST_KV_BYTES, TINY_MAX_MODEL_LEN, TINY_NAME, wait_for
from batch_pipeline_tests.support.orphan_watch import group_alive
from batch_pipeline_tests.support.signals import as_from_a_terminal

LOCATION = "batch_pipeline"  # workspace.yaml's location_name
REPOSITORY = "__repository__"  # the repository name of a @dg.definitions module

_WRAPPER = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_home(home: Path, instance_yaml: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Path:
    """DAGSTER_HOME with instance settings (default: the repo's dagster.yaml; `overrides` merged into
    its sections, e.g. a test's quicker poll) and the UI's first-visit modal dismissed."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(instance_yaml or REPO / "dagster.yaml", home / "dagster.yaml")
    if overrides:
        settings = yaml.safe_load((home / "dagster.yaml").read_text()) or {}
        for section, values in overrides.items():
            settings[section] = {**(settings.get(section) or {}), **values}
        (home / "dagster.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    (home / ".nux").mkdir(exist_ok=True)
    (home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    return home


class GraphQLError(RuntimeError):
    pass


@dataclass
class DagsterDev:
    process: subprocess.Popen
    home: Path
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- talking to it ----------------------------------------------------------------------

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        payload = json.dumps({"query": query, "variables": dict(variables or {})}).encode()
        request = urllib.request.Request(
            f"{self.url}/graphql", data=payload, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
        if body.get("errors"):
            raise GraphQLError(json.dumps(body["errors"])[:2000])
        return body["data"]

    def instance(self) -> Any:
        """The same instance, opened in this process (reads are safe). With deploy/dagster.yaml the
        DAGSTER_POSTGRES_* variables must be set in this process too."""
        import dagster as dg

        return dg.DagsterInstance.from_config(str(self.home))

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no dagster dev log)"
        return "\n".join(text.splitlines()[-lines:])

    def start_sensor(self, name: str) -> None:
        data = self.graphql(
            """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {
                 __typename ... on Sensor { sensorState { status } } ... on PythonError { message } } }""",
            {"s": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "sensorName": name}},
        )["startSensor"]
        if data["__typename"] != "Sensor" or data["sensorState"]["status"] != "RUNNING":
            raise GraphQLError(f"startSensor {name}: {data}")

    def start_schedule(self, name: str) -> None:
        data = self.graphql(
            """mutation($s: ScheduleSelector!) { startSchedule(scheduleSelector: $s) {
                 __typename ... on ScheduleStateResult { scheduleState { status } } ... on PythonError { message } } }""",
            {"s": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "scheduleName": name}},
        )["startSchedule"]
        if data["__typename"] != "ScheduleStateResult" or data["scheduleState"]["status"] != "RUNNING":
            raise GraphQLError(f"startSchedule {name}: {data}")

    def sensor_ticks(self, name: str, limit: int = 20) -> list[dict[str, Any]]:
        """Newest first: status, cursor, runIds, timestamp."""
        data = self.graphql(
            """query($s: SensorSelector!, $n: Int) { sensorOrError(sensorSelector: $s) {
                 __typename ... on Sensor { sensorState { ticks(limit: $n) { status cursor runIds timestamp
                   error { message } } } } } }""",
            {"s": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "sensorName": name}, "n": limit},
        )["sensorOrError"]
        return data["sensorState"]["ticks"]

    # -- lifetime ----------------------------------------------------------------------------

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"dagster dev exited with {self.process.returncode}\n{self.log_tail()}")
        try:
            data = self.graphql(
                """{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
                       locationOrLoadError { __typename ... on PythonError { message } } } } }
                     instance { daemonHealth { allDaemonStatuses { daemonType required healthy } } } }""",
                timeout=10,
            )
        except (OSError, urllib.error.URLError, GraphQLError):
            return False
        entries = data["workspaceOrError"].get("locationEntries") or []
        for entry in entries:
            error = entry["locationOrLoadError"] or {}
            if error.get("__typename") == "PythonError":
                raise RuntimeError(f"code location {entry['name']} failed to load: {error['message']}")
        loaded = any(e["name"] == LOCATION and e["loadStatus"] == "LOADED" for e in entries)
        daemons = data["instance"]["daemonHealth"]["allDaemonStatuses"]
        return loaded and all(d["healthy"] for d in daemons if d["required"])

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crashed server: no shutdown code runs)."""
        self.stop()

    def stop(self) -> None:
        """End the process group (web server, daemon, code server, run workers) with SIGKILL and wait
        until none of it is left. The instance is thrown away, so there is nothing to shut down
        cleanly: SIGTERM's clean shutdown took 9-15 s a server on 2 cores, for nothing."""
        pgid = self.process.pid  # its own session (start_new_session): the group has its pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group is gone already
            self.process.poll()
            return
        self.process.wait(timeout=30)
        # The leader is gone; make sure no child of the group lingers (run workers).
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.2)  # a poll interval: cleanup waits a while for the group, it never fails


def pipeline_env(tiny_model_dir: Path, input_path: str, output_path: str, engine_url: str | None = None,
                 **extra: str | None) -> dict[str, str | None]:
    """What a `dagster dev` of these tests needs: storage paths and the tiny model (None unsets), its runs
    answered by the warm engine at `engine_url` (the warm_engine_url fixture) or, without one, in-process."""
    return {
        "STORAGE_INPUT_PATH": input_path,
        "STORAGE_OUTPUT_PATH": output_path,
        "MODEL_PATH": str(tiny_model_dir),
        "SERVED_MODEL_NAME": TINY_NAME,
        "MAX_MODEL_LEN": str(TINY_MAX_MODEL_LEN),
        "KV_CACHE_MEMORY_BYTES": str(TEST_KV_BYTES),
        "BATCH_PIPELINE_CACHE": os.environ["BATCH_PIPELINE_CACHE"],
        "ENGINE_URL": engine_url,
        "SHARD_SIZE": None,
        "CHECKPOINT_ANSWERS": None,
        "CHECKPOINT_SECONDS": None,
        # Sensor ticks every 5 s instead of 30: the tests wait for ticks, not for the interval.
        "SENSOR_INTERVAL_SECONDS": "5",
        **extra,
    }


def start_dagster_dev(home: Path, env: Mapping[str, str | None], log_path: Path, timeout: float = 180.0,
                      instance_yaml: Path | None = None, overrides: Mapping[str, Any] | None = None) -> DagsterDev:
    """`dagster dev -w workspace.yaml` on 127.0.0.1 with DAGSTER_HOME=home, `env` added (None: unset).

    `instance_yaml` is the dagster.yaml copied into `home` (default: the repo's SQLite one; pass
    deploy/dagster.yaml, with DAGSTER_POSTGRES_* in `env`, for the production instance), with
    `overrides` merged into its sections."""
    prepare_home(home, instance_yaml, overrides)
    port = free_port()
    dagster = str(Path(sys.executable).with_name("dagster"))
    merged = {**os.environ, **env, "DAGSTER_HOME": str(home)}
    full_env = {k: v for k, v in merged.items() if v is not None}
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child; closed with it
    process = subprocess.Popen(
        [sys.executable, "-c", _WRAPPER, dagster, "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stop() ends every child with it
        preexec_fn=as_from_a_terminal,  # its runs' cancels (SIGINT) reach them, as under a user's shell
    )
    log.close()
    server = DagsterDev(process=process, home=home, port=port, log_path=log_path)
    try:
        wait_for("dagster dev ready (location loaded, daemons healthy)", server._ready, timeout, interval=1.0,
                 on_timeout=server.log_tail)
    except BaseException:
        server.stop()
        raise
    return server

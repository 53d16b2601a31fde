"""A local S3 for tests: moto's standalone server (`moto_server`) on 127.0.0.1, over real HTTP.

Covers: starting/stopping the server on a free port, the standard AWS environment pointing at it
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` = ``testing``,
``AWS_REGION`` = ``us-east-1``), and a fresh bucket per test. Does not touch real AWS, does not
mock boto3, and does not read ~/.aws (the config/credentials files are pointed at nothing).

Use from a test module::

    from batch_pipeline_tests.support.s3_server import moto_server, s3_bucket, s3_env  # noqa: F401

    def test_x(s3_bucket):            # env set, storage clients reset, bucket created
        uri = f"s3://{s3_bucket}/a.jsonl"

Or, for a subprocess, ``with running_moto_server() as server: env = {**os.environ, **server.env()}``.

``start_moto_server(seed={bucket: {key: body}})`` starts a server whose buckets already hold those
objects: they are put through moto's own S3 backend in the server process before it serves, which
takes a second for 20,000 objects where 20,000 PUTs over HTTP take minutes on 2 busy cores (moto
answers ~150 a second). Objects put that way are ordinary objects to every client.

The server runs in its own process, not as moto's ThreadedMotoServer: that would import Flask into
the test process, and vLLM's kernel registration walks every module's attributes and trips over
Flask's `current_app` proxy ("Working outside of application context"). Each test gets its own
bucket name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest

from batch_pipeline_tests.support import wait_for

REGION = "us-east-1"

# Variables that could point boto3 somewhere else than the test server; removed in s3_env.
_FOREIGN_AWS_VARS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "S3_SSE",
    "S3_SSE_KMS_KEY_ID",
)


@dataclass
class MotoS3:
    process: subprocess.Popen
    host: str
    port: int
    buckets: list[str] = field(default_factory=list)

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment a process needs to talk to this server (merge into os.environ)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        """A boto3 client for assertions, independent of the code under test."""
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name=REGION,
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `moto_server`, after putting the objects of a seed file (JSON: bucket -> key -> body as latin-1
# text) into moto's S3 backend of the default account, in the same process.
_SEEDED_SERVER = (
    "import json, sys\n"
    "from moto.core import DEFAULT_ACCOUNT_ID\n"
    "from moto.s3.models import s3_backends\n"
    "from moto.server import main\n"
    "backend = s3_backends[DEFAULT_ACCOUNT_ID]['aws']\n"
    "with open(sys.argv[1]) as f:\n"
    "    seed = json.load(f)\n"
    "for bucket, objects in seed.items():\n"
    f"    backend.create_bucket(bucket, {REGION!r})\n"
    "    for key, body in objects.items():\n"
    "        backend.put_object(bucket, key, body.encode('latin-1'))\n"
    "main(sys.argv[2:])\n"
)


def start_moto_server(timeout: float = 30.0, seed: Mapping[str, Mapping[str, bytes]] | None = None) -> MotoS3:
    """Start `moto_server` on 127.0.0.1 and a free port; returns once it answers HTTP. With `seed`
    (bucket -> key -> body), those buckets and objects exist when it starts answering."""
    port = _free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "moto_server")]
    with tempfile.TemporaryDirectory() as scratch:
        if seed:
            seed_file = os.path.join(scratch, "seed.json")
            with open(seed_file, "w") as f:
                json.dump({b: {k: v.decode("latin-1") for k, v in objects.items()} for b, objects in seed.items()}, f)
            command = [sys.executable, "-c", _SEEDED_SERVER, seed_file]
        process = subprocess.Popen(
            [*command, "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # werkzeug logs every request
        )

        def listening() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return True
            except OSError:
                return False

        try:
            wait_for(f"moto_server listening on port {port}", listening, timeout, interval=0.1)
        except BaseException:
            process.kill()
            raise
        return MotoS3(process=process, host="127.0.0.1", port=port, buckets=list(seed or ()))


@contextmanager
def running_moto_server(seed: Mapping[str, Mapping[str, bytes]] | None = None) -> Iterator[MotoS3]:
    server = start_moto_server(seed=seed)
    try:
        yield server
    finally:
        server.stop()


def apply_env(monkeypatch: pytest.MonkeyPatch, server: MotoS3) -> dict[str, str]:
    """Point this process at ``server`` (undone by monkeypatch) and drop cached storage clients."""
    from batch_pipeline.io import storage

    for name in _FOREIGN_AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    env = server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    storage.reset_clients()
    return env


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    with running_moto_server() as server:
        yield server


@pytest.fixture
def s3_env(moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The AWS environment for the test server, set for the duration of one test."""
    from batch_pipeline.io import storage

    env = apply_env(monkeypatch, moto_server)
    yield env
    storage.reset_clients()  # runs before monkeypatch restores the environment


@pytest.fixture
def s3_bucket(moto_server: MotoS3, s3_env: dict[str, str]) -> str:
    """A fresh, empty bucket on the test server (with s3_env applied)."""
    return moto_server.create_bucket()

"""A PostgreSQL server for tests: where it is (TEST_POSTGRES_* variables, 127.0.0.1:5432 as
postgres by default), whether it answers, connections, and fresh databases.

Holds the server's settings (PG_HOST, PG_PORT, PG_USER, PG_PASSWORD), why it cannot be reached
(`reachable`: None when it can), a connection to one of its databases in autocommit mode
(`connect`, psycopg2) and a new, empty database dropped afterwards (`fresh_database`). Used by
test_postgres.py (the production instance, deploy/dagster.yaml, on its own database) and
test_batch_api.py (the service's `dagster dev` on the production instance settings when the server
is reachable).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

PG_HOST = os.environ.get("TEST_POSTGRES_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("TEST_POSTGRES_PORT", "5432"))
PG_USER = os.environ.get("TEST_POSTGRES_USER", "postgres")
PG_PASSWORD = os.environ.get("TEST_POSTGRES_PASSWORD", "")


def reachable() -> str | None:
    """None when the server accepts connections, else why not."""
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=2):
            return None
    except OSError as e:
        return f"PostgreSQL not reachable at {PG_HOST}:{PG_PORT} ({e})"


def connect(dbname: str):
    import psycopg2  # dagster-postgres depends on psycopg2-binary

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, password=PG_PASSWORD, dbname=dbname)
    conn.autocommit = True
    return conn


@contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new, empty database, dropped (connections and all) afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = connect("postgres")
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        yield name
    finally:
        with admin.cursor() as cur:
            # FORCE (PostgreSQL 13+) ends connections a pooled engine may still hold.
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

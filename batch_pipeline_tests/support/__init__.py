"""What the test files share, imported by name from here: the tiny model's names and settings, the
session's shared engines, the environment of a `batch-pipeline` subprocess, and `wait_for`.

conftest.py holds only what pytest itself looks for (fixtures, hooks, the process set-up before any
import); it takes what it needs from here, and no test file imports from it.
"""

from batch_pipeline_tests.support.engines import (
    EMBED_NAME,
    REPO,
    TEST_KV_BYTES,
    TINY_MAX_MODEL_LEN,
    TINY_NAME,
    SessionLLM,
    session_engine,
    shutdown_session_engines,
    tiny_env,
)
from batch_pipeline_tests.support.waiting import wait_for

__all__ = [
    "EMBED_NAME",
    "REPO",
    "TEST_KV_BYTES",
    "TINY_MAX_MODEL_LEN",
    "TINY_NAME",
    "SessionLLM",
    "session_engine",
    "shutdown_session_engines",
    "tiny_env",
    "wait_for",
]

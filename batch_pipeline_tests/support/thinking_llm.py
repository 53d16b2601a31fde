"""The thinking SmolLM2 (thinking_model.py) as an LLM resource with vLLM's `deepseek_r1` reasoning
parser, and what makes it think.

Holds its served name (THINKING), the structured-output regex that makes it write
`<think>...</think>` before an answer (REGEX) and the `logit_bias` on the two tag tokens that makes it
write them as the single tokens a reasoning model emits (TAGS), and the fixtures `thinking_model_dir`
(module-scoped: the model built once in the cache) and `thinking_llm` (the LLM resource on it).
conftest.py registers this module as a plugin. Used by test_reasoning.py and test_responses_api.py.
"""

from __future__ import annotations

import pytest

from batch_pipeline_tests.support import SessionLLM
from batch_pipeline_tests.support.thinking_model import build_thinking_smollm2

THINKING = "smollm2-thinking"
THINK_OPEN, THINK_CLOSE = 8, 9  # the token ids thinking_model.py renames
REGEX = r"<think>[a-z ]{1,40}</think>[A-Z][a-z]{1,20}"
TAGS = {str(THINK_OPEN): 50, str(THINK_CLOSE): 50}


@pytest.fixture(scope="module")
def thinking_model_dir(bundled_model_dir):
    from batch_pipeline.config import models

    return build_thinking_smollm2(bundled_model_dir, models.cache_root() / "test-models" / THINKING)


@pytest.fixture
def thinking_llm(thinking_model_dir, monkeypatch) -> SessionLLM:
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "REASONING_PARSER", "CHECKPOINT_ANSWERS", "CHECKPOINT_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KV_CACHE_MEMORY_BYTES", str(256 * 2**20))
    return SessionLLM(model_path=str(thinking_model_dir), served_model_name=THINKING, max_model_len=1024,
                      reasoning_parser="deepseek_r1")

"""The tiny random vision-language model (tiny_vlm.py) on vLLM's CPU build: an image reaches the model.

Runs the real engine in-process through `LLM.chat` with OpenAI `image_url` parts carrying data URLs
(images drawn with PIL here, never stored). Does not touch the pipeline's validation, fetching or
assets: this pins only that vLLM's CPU build serves a vision model and that the answer depends on
the image, which the image tests of the pipeline rely on.
"""

from __future__ import annotations

import base64
import io

import pytest

from batch_pipeline.lib import models
from batch_pipeline.lib.vllm_adapter import build_llm, shutdown_llm
from batch_pipeline_tests.tiny_vlm import IMAGE_SEQ_LEN, build_tiny_vlm

pytestmark = pytest.mark.engine

TINY_VLM_NAME = "tiny-idefics3"


def png_data_url(color: str, size: tuple[int, int] = (80, 60)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm():
    path = build_tiny_vlm(models.cache_root() / "test-models" / TINY_VLM_NAME)
    llm = build_llm({
        "model": str(path), "dtype": "float32", "enforce_eager": True, "max_model_len": 512,
        "kv_cache_memory_bytes": 64 * 2**20, "limit_mm_per_prompt": {"image": 2}, "seed": 0,
    })
    yield llm
    shutdown_llm(llm)


def _ask(llm, urls: list[str]) -> list:
    from vllm import SamplingParams

    conversations = [
        [{"role": "user", "content": [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]}]
        for url in urls
    ]
    return llm.chat(conversations, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)


def test_the_image_decides_the_greedy_answer(vlm):
    red, blue, red_again = _ask(vlm, [png_data_url("red"), png_data_url("blue"), png_data_url("red")])
    assert red.outputs[0].token_ids != blue.outputs[0].token_ids
    assert red.outputs[0].token_ids == red_again.outputs[0].token_ids
    # The prompt holds the image's tokens, counted as prompt tokens (as vLLM's usage does).
    text_only = vlm.chat([[{"role": "user", "content": "describe"}]], use_tqdm=False)[0]
    assert len(red.prompt_token_ids) >= len(text_only.prompt_token_ids) + IMAGE_SEQ_LEN


def test_two_images_in_one_request(vlm):
    from vllm import SamplingParams

    conversation = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url("red")}},
        {"type": "image_url", "image_url": {"url": png_data_url("blue", (30, 90))}},
        {"type": "text", "text": "compare"},
    ]}]
    out = vlm.chat([conversation], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids

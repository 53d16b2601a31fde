"""The tiny random vision-language model (tiny_vlm.py) on vLLM's CPU build: an image reaches the model.

Runs the real engine in-process (built from engine_args.engine_kwargs, as runs build it) through
`LLM.chat`, with OpenAI `image_url` parts carrying data URLs, and with images fetched and decoded
ahead of the engine by io/images.py (data URLs and objects on the repo's S3 test server) and handed
over decoded. Images are drawn with PIL here, never stored. Does not touch validation or the assets:
the pipeline's run path does not pass images to the engine yet (issue 27).
"""

from __future__ import annotations


import pytest

from batch_pipeline.engine import engine_args
from batch_pipeline.io import images, storage
from batch_pipeline.config import models
from batch_pipeline.contract import CHAT_URL
from batch_pipeline.config.settings import EngineSettings
from batch_pipeline_tests.support import session_engine
from batch_pipeline_tests.support.image_data import data_url, png
from batch_pipeline_tests.support.s3_server import moto_server, s3_bucket, s3_env  # noqa: F401
from batch_pipeline_tests.support.tiny_vlm import IMAGE_SEQ_LEN, build_tiny_vlm

pytestmark = pytest.mark.engine

TINY_VLM_NAME = "tiny-idefics3"


def png_data_url(color: str, size: tuple[int, int] = (80, 60)) -> str:
    return data_url(png(color, size))


@pytest.fixture(scope="module")
def vlm_dir():
    return build_tiny_vlm(models.cache_root() / "test-models" / TINY_VLM_NAME)


def _kwargs(path, **env_free_settings) -> dict:
    settings = EngineSettings(kv_cache_memory_bytes=64 * 2**20, max_model_len=512, seed=0, **env_free_settings)
    return engine_args.engine_kwargs(settings, str(path), TINY_VLM_NAME, "generate")


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    # A session engine, shut down with the others at the end: shutting an in-process engine down
    # here tears down vLLM's process-wide parallel groups, which the other session engines of this
    # worker still use ("pipeline model parallel group is not initialized" in later tests).
    return session_engine(_kwargs(vlm_dir))


def test_engine_arguments_hold_images_to_max_images_per_request(vlm_dir, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("MAX_IMAGES_PER_REQUEST", raising=False)
    assert _kwargs(vlm_dir)["limit_mm_per_prompt"] == {"image": images.DEFAULT_MAX_IMAGES_PER_REQUEST}
    monkeypatch.setenv("MAX_IMAGES_PER_REQUEST", "2")
    assert _kwargs(vlm_dir)["limit_mm_per_prompt"] == {"image": 2}
    assert "limit_mm_per_prompt" not in _kwargs(tiny_model_dir)


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


def test_images_prepared_ahead_reach_the_model_the_same_from_a_data_url_and_s3(vlm, s3_bucket):
    from vllm import SamplingParams


    red, blue = png("red", (80, 60)), png("blue", (80, 60))
    storage.write_bytes(f"s3://{s3_bucket}/red.png", red)
    storage.write_bytes(f"s3://{s3_bucket}/blue.png", blue)

    def body(url: str) -> dict:
        return {"model": TINY_VLM_NAME, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": url}}]}]}

    bodies = [body(f"s3://{s3_bucket}/red.png"), body(png_data_url("red")), body(f"s3://{s3_bucket}/blue.png"),
              body(f"s3://{s3_bucket}/missing.png")]
    with images.ImageResolver(images.ImageSettings(concurrency=2)) as resolver:
        prepared = list(resolver.resolve_all((i, CHAT_URL, b) for i, b in enumerate(bodies)))
    assert [p.error is None for p in prepared] == [True, True, True, False]
    conversations = [images.chat_messages_with_images(b["messages"], p.images) for b, p in zip(bodies, prepared) if p.error is None]
    s3_red, data_red, s3_blue = vlm.chat(conversations, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert s3_red.outputs[0].token_ids == data_red.outputs[0].token_ids
    assert s3_red.outputs[0].token_ids != s3_blue.outputs[0].token_ids
    # The decoded hand-over is what vLLM would have made of the data URL itself.
    direct = _ask(vlm, [png_data_url("red")])[0]
    assert direct.outputs[0].token_ids == data_red.outputs[0].token_ids

"""Images through the whole pipeline: the contract, validation, the engine stream and the assets.

The contract half needs no engine: chat `image_url` parts and Responses `input_image` items are
valid lines for a model that takes images (a model folder whose config.json has a `vision_config`,
as LLMResource.validation_settings reads it), refused per line naming the part otherwise; a
Responses line runs as the chat it amounts to, images included.

The engine half runs the real tiny Idefics3 (tiny_vlm.py) as a session engine, through `run_batch`
(what `batch-pipeline run` runs) with images as data URLs and on the repo's S3 test server (moto),
and `batch-pipeline run` itself in its own process, killed with SIGKILL mid-batch. Images are drawn
with PIL here, never stored. Does not touch the Batch API or the sensor.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.defs.jobs import run_batch
from batch_pipeline.config import models
from batch_pipeline import contract
from batch_pipeline.defs.resources import LLMResource, StorageResource
from batch_pipeline.io import images, storage
from batch_pipeline.steps.validation import InvalidLine, LineValidator, ValidLine
from batch_pipeline_tests.support import image_data
from batch_pipeline_tests.support.asset_runs import write_batch
from batch_pipeline_tests.support.cli_runs import answered_once, killed_after_parts, read_results
from batch_pipeline_tests.support.image_data import data_url
from batch_pipeline_tests.support import SessionLLM
from batch_pipeline_tests.support.s3_server import moto_server, s3_bucket, s3_env  # noqa: F401

VLM = "tiny-idefics3"
CHAT, RESPONSES = contract.CHAT_URL, contract.RESPONSES_URL


def png(color: Any = "red", size: tuple[int, int] = (80, 60), fmt: str = "PNG") -> bytes:
    return image_data.png(color, size, fmt=fmt)  # this file's pictures are 80x60


def chat_body(*urls: str, text: str = "describe", model: str = VLM, **extra: Any) -> dict:
    parts = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return {"model": model, "messages": [{"role": "user", "content": parts}], **extra}


def responses_body(*urls: str, text: str = "describe", model: str = VLM, **extra: Any) -> dict:
    parts = [{"type": "input_text", "text": text}, *({"type": "input_image", "image_url": u} for u in urls)]
    return {"model": model, "input": [{"role": "user", "content": parts}], **extra}


def line(custom_id: str, body: dict, url: str = CHAT) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# ----------------------------------------------------------------------------- the contract


@pytest.fixture
def vision_folder(tmp_path: Path) -> Path:
    """A model folder that says it takes images (config.json only: nothing is loaded here)."""
    folder = tmp_path / "some-vlm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Idefics3ForConditionalGeneration"],
                                                    "vision_config": {"hidden_size": 64}}))
    return folder


def test_a_model_that_takes_images_is_named_in_the_validation_settings(vision_folder, monkeypatch):
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "MODELS_FILE", "LORA_MODULES"):
        monkeypatch.delenv(var, raising=False)
    settings = LLMResource(model_path=str(vision_folder), served_model_name=VLM).validation_settings()
    assert settings.image_models == (VLM,)
    text_only = vision_folder.parent / "text-model"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert LLMResource(model_path=str(text_only)).validation_settings().image_models == ()
    # MODELS_FILE: each model by its own folder.
    registry = vision_folder.parent / "models.yaml"
    registry.write_text(f"models:\n  other-vlm:\n    path: {vision_folder}\n")
    settings = LLMResource(model_path=str(text_only), models_file=str(registry)).validation_settings()
    assert settings.image_models == ("other-vlm",)


def _validator(vision_folder: Path) -> LineValidator:
    return LineValidator(LLMResource(model_path=str(vision_folder), served_model_name=VLM).validation_settings())


@pytest.mark.parametrize("url, body", [
    (CHAT, chat_body("data:image/png;base64,AAAA")),
    (CHAT, chat_body("s3://bucket/a.png", "https://img.example.com/b.jpg")),
    (CHAT, {"model": VLM, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "s3://b/a.png", "detail": "low"}}]}]}),
    (RESPONSES, responses_body("s3://bucket/a.png")),
    (RESPONSES, {"model": VLM, "instructions": "be brief", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "s3://b/a.png", "detail": "high"}, {"type": "input_text", "text": "what"}]}]}),
])
def test_image_parts_are_valid_lines_for_a_model_that_takes_images(vision_folder, monkeypatch, url, body):
    monkeypatch.delenv("MODELS_FILE", raising=False)
    monkeypatch.setenv("IMAGE_URL_ALLOWED_HOSTS", "img.example.com")
    assert isinstance(_validator(vision_folder).validate(3, line("c", body, url).encode()), ValidLine)


@pytest.mark.parametrize("url, body, message", [
    (CHAT, {"model": VLM, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "body.messages[0].content[0].image_url.url: required field is missing"),
    (CHAT, chat_body("s3://b/a.png") | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "s3://b/a.png", "detail": "huge"}}]}]},
     "body.messages[0].content[0].image_url.detail: Input should be 'auto', 'low' or 'high'"),
    (CHAT, {"model": VLM, "messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "s3://b/a.png"}}]}, {"role": "user", "content": "hi"}]},
     "body.messages[0]: content: image parts are taken in user messages only, not in a system message"),
    (CHAT, {"model": VLM, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "body.messages[0].content[0].type: Input should be 'text'"),
    (RESPONSES, {"model": VLM, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "body.input[0].content[0]: file_id: file ids are not supported; give image_url"),
    (RESPONSES, {"model": VLM, "input": [{"role": "assistant", "content": [
        {"type": "input_image", "image_url": "s3://b/a.png"}]}]},
     "body.input[0]: content: input_image parts are taken in user messages only, not in a assistant message"),
])
def test_bad_image_parts_are_refused_naming_the_part(vision_folder, monkeypatch, url, body, message):
    monkeypatch.delenv("MODELS_FILE", raising=False)
    result = _validator(vision_folder).validate(3, line("c", body, url).encode())
    assert isinstance(result, InvalidLine) and result.code == "invalid_request"
    assert result.message.startswith(f"line 3: {message}"), result.message


# Lines whose images validation refuses without fetching or decoding: custom_id -> (body, url).
BAD_IMAGE_LINES = {
    "bad-base64": (chat_body("data:image/png;base64,@@not base64@@"), CHAT),
    "not-base64": (chat_body("data:image/png,rawbytes"), CHAT),
    "text-type": (chat_body(data_url(png(), "text/plain")), CHAT),
    "too-big": (chat_body(data_url(png("red", (200, 200), "BMP"), "image/bmp")), CHAT),
    "too-many": (chat_body(*[data_url(png())] * 3), CHAT),
    "not-allowed": (chat_body("https://images.example.com/a.png"), CHAT),
    "http": (chat_body("http://127.0.0.1/a.png"), CHAT),
    "responses-scheme": (responses_body("file:///etc/passwd"), RESPONSES),
    "second-part": (chat_body(data_url(png()), "gs://bucket/a.png"), CHAT),
}
IMAGE_LIMITS = {"MAX_IMAGE_BYTES": "20000", "MAX_IMAGES_PER_REQUEST": "2", "IMAGE_URL_ALLOWED_HOSTS": "127.0.0.1"}


def test_validation_refuses_bad_images_per_line_with_the_runs_own_message(vision_folder, monkeypatch):
    """Each line whose image the run would refuse before fetching it is an error line at validation,
    naming the line and the part, with the message the engine stream gives for it."""
    monkeypatch.delenv("MODELS_FILE", raising=False)
    for name, value in IMAGE_LIMITS.items():
        monkeypatch.setenv(name, value)
    validator = _validator(vision_folder)
    settings = images.image_settings_from_env()
    with images.ImageResolver(settings) as resolver:  # what the run does with the line (generation.stream)
        for number, (custom_id, (body, url)) in enumerate(BAD_IMAGE_LINES.items(), start=1):
            result = validator.validate(number, line(custom_id, body, url).encode())
            assert isinstance(result, InvalidLine) and result.code == "invalid_request", (custom_id, result)
            in_the_run = resolver.submit(number, url, body).result().error
            assert in_the_run is not None and result.message == f"line {number}: {in_the_run}", custom_id
            assert result.custom_id == custom_id
    # What only a fetch or a decode can tell stays the run's: these lines are valid.
    for n, body in enumerate((chat_body(data_url(b"not an image")), chat_body("s3://no-such-bucket/a.png"),
                              chat_body("https://127.0.0.1/a.png"), chat_body(data_url(png("red", (400, 300)))))):
        assert isinstance(validator.validate(20 + n, line(f"fine-{n}", body).encode()), ValidLine), n


def test_validate_command_reports_bad_images_without_fetching_or_decoding(vision_folder, tmp_path, monkeypatch, capsys):
    from batch_pipeline.cli.main import EXIT_INVALID_LINES, main

    for var in ("MODELS_FILE", "LORA_MODULES", "DAGSTER_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODEL_PATH", str(vision_folder))
    monkeypatch.setenv("SERVED_MODEL_NAME", VLM)
    for name, value in IMAGE_LIMITS.items():
        monkeypatch.setenv(name, value)

    def no_io(*args: Any) -> None:
        raise AssertionError("validate fetched or decoded an image")

    for name in ("decode", "_s3_bytes", "_https_bytes"):
        monkeypatch.setattr(images, name, no_io)
    good = [line("red", chat_body(data_url(png("red")))), line("s3", chat_body("s3://bucket/a.png"))]
    bad = [line(custom_id, body, url) for custom_id, (body, url) in BAD_IMAGE_LINES.items()]
    batch = tmp_path / "images.jsonl"
    batch.write_text("\n".join(good + bad) + "\n")
    assert main(["validate", str(batch)]) == EXIT_INVALID_LINES
    out = capsys.readouterr().out
    assert f"{len(good) + len(bad)} requests: {len(good)} valid, {len(bad)} invalid (invalid_request={len(bad)})" in out
    assert "line 3 [invalid_request] custom_id='bad-base64': body.messages[0].content[1].image_url: the data: URL is " \
           "not valid base64" in out
    assert "line 8 [invalid_request] custom_id='not-allowed': body.messages[0].content[1].image_url: https images " \
           "from images.example.com are not allowed (IMAGE_URL_ALLOWED_HOSTS: 127.0.0.1)" in out
    assert "line 7 [invalid_request] custom_id='too-many': body.messages[0].content[3].image_url: 3 images in one " \
           "request, more than MAX_IMAGES_PER_REQUEST=2" in out
    assert "custom_id='second-part': body.messages[0].content[2].image_url: unsupported image url 'gs://bucket/a.png'" in out


def test_a_responses_line_runs_as_the_chat_with_its_images_in_place():
    body = contract.ResponsesBody.model_validate({"model": VLM, "instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "first"},
                                     {"type": "input_image", "image_url": "s3://b/1.png", "detail": "low"},
                                     {"type": "input_text", "text": "then"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]})
    chat = body.as_chat()
    assert [m.role for m in chat.messages] == ["system", "user"]
    user = chat.messages[1]
    assert user.text() == "first\nthen"
    assert [p.image_url.url for p in user.images()] == ["s3://b/1.png", "data:image/png;base64,AAAA"]
    assert [p.type for p in user.content] == ["text", "image_url", "text", "image_url"]
    # The images are found in the same order in the Responses line and in the chat it runs as.
    source = body.model_dump(exclude_none=True)
    assert [r.url for r in images.image_refs(RESPONSES, source)] == [
        r.url for r in images.image_refs(CHAT, chat.model_dump(exclude_none=True))]
    # A text-only Responses line is the same chat as before images existed.
    plain = contract.ResponsesBody.model_validate({"model": VLM, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}).as_chat()
    assert plain.messages[0].content == "a\nb"


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def vlm_dir() -> Path:
    from batch_pipeline_tests.support.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(models.cache_root() / "test-models" / VLM)


@pytest.fixture
def vlm_llm(vlm_dir, monkeypatch) -> SessionLLM:
    """The LLM resource on the tiny VLM, its engine the session's (as test_images_model.py builds it)."""
    for var in ("MODEL_PATH", "SERVED_MODEL_NAME", "MAX_MODEL_LEN", "MODELS_FILE", "LORA_MODULES", "CHECKPOINT_ANSWERS",
                "CHECKPOINT_SECONDS", "ORDER", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_IMAGES_PER_REQUEST",
                "IMAGE_URL_ALLOWED_HOSTS", "IMAGE_FETCH_CONCURRENCY", "IMAGE_FETCH_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KV_CACHE_MEMORY_BYTES", str(64 * 2**20))
    return SessionLLM(model_path=str(vlm_dir), served_model_name=VLM, max_model_len=512, seed=0)


def run(llm: SessionLLM, batch: Path, out: Path, instance: Any = None) -> tuple[Any, list[str]]:
    """run_batch (what `batch-pipeline run` runs) on the session's engine; its result and log lines."""
    storage_resource = StorageResource(input_path=str(batch.parent), output_path=str(out))
    with dg.instance_for_test() if instance is None else _same(instance) as used:
        result = run_batch(str(batch), str(out), "2026-11-30", resources={"llm": llm, "storage": storage_resource},
                           instance=used)
        messages = [str(r.user_message) for r in used.all_logs(result.run_id)]
    return result, messages


class _same:
    def __init__(self, instance: Any):
        self.instance = instance

    def __enter__(self) -> Any:
        return self.instance

    def __exit__(self, *exc: Any) -> None:
        return None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_images_reach_the_model_through_the_pipeline_and_bad_ones_fail_their_line_only(vlm_llm, s3_bucket, tmp_path,
                                                                                    monkeypatch):
    red, blue = png("red"), png("blue")
    storage.write_bytes(f"s3://{s3_bucket}/red.png", red)
    monkeypatch.setenv("MAX_IMAGE_BYTES", "20000")
    monkeypatch.setenv("MAX_IMAGE_PIXELS", "100000")
    monkeypatch.setenv("MAX_IMAGES_PER_REQUEST", "2")
    monkeypatch.setenv("IMAGE_URL_ALLOWED_HOSTS", "127.0.0.1")
    monkeypatch.setenv("IMAGE_FETCH_TIMEOUT", "2")
    greedy = {"max_tokens": 8, "temperature": 0}
    where = "body.messages[0].content[1].image_url"
    good = [
        line("red", chat_body(data_url(red), **greedy)),
        line("blue", chat_body(data_url(blue), **greedy)),
        line("red-s3", chat_body(f"s3://{s3_bucket}/red.png", **greedy)),
        line("red-responses", responses_body(data_url(red), max_output_tokens=8, temperature=0), RESPONSES),
        line("two", chat_body(data_url(red), data_url(png("white", (30, 90))), **greedy)),
        line("text", {"model": VLM, "messages": [{"role": "user", "content": "describe"}], **greedy}),
    ]
    bad = {  # custom_id: (line, where, reason)
        "bad-base64": (chat_body("data:image/png;base64,@@not base64@@"), where, "the data: URL is not valid base64"),
        "not-an-image": (chat_body(data_url(b"plain text, not an image")), where, "not an image format that can be read"),
        "too-big": (chat_body(data_url(png("red", (200, 200), "BMP"), "image/bmp")), where,
                    "image is larger than MAX_IMAGE_BYTES=20000"),
        "too-many-pixels": (chat_body(data_url(png("red", (400, 300)))), where,
                            "image is 400x300 pixels, more than MAX_IMAGE_PIXELS=100000"),
        "too-many-images": (chat_body(*[data_url(red)] * 3), "body.messages[0].content[3].image_url",
                            "3 images in one request, more than MAX_IMAGES_PER_REQUEST=2"),
        "not-allowed": (chat_body("https://images.example.com/a.png"), where,
                        "https images from images.example.com are not allowed (IMAGE_URL_ALLOWED_HOSTS: 127.0.0.1)"),
        "unreachable": (chat_body(f"https://127.0.0.1:{_closed_port()}/a.png"), where,
                        "could not fetch the image from 127.0.0.1"),
        "missing-s3": (chat_body(f"s3://{s3_bucket}/missing.png"), where, f"no such S3 object: s3://{s3_bucket}/missing.png"),
        "responses-missing": (responses_body(f"s3://{s3_bucket}/gone.png"), "body.input[0].content[1].image_url",
                              f"no such S3 object: s3://{s3_bucket}/gone.png"),
    }
    lines = good[:3] + [line(i, b, RESPONSES if i.startswith("responses") else CHAT) for i, (b, _, _) in bad.items()] + good[3:]
    batch = write_batch(tmp_path / "in", "images.jsonl", lines)
    out = tmp_path / "out"

    result, messages = run(vlm_llm, batch, out)
    assert result.success
    outputs, errors, batch_obj = read_results(out)
    ids = [json.loads(x)["custom_id"] for x in lines]
    answered_once(outputs, errors, ids)
    assert batch_obj["request_counts"] == {"total": len(lines), "completed": len(good), "failed": len(bad)}
    number = {custom_id: n for n, custom_id in enumerate(ids, start=1)}
    for error in errors:
        custom_id = error["custom_id"]
        _, part, reason = bad[custom_id]
        assert error["response"] is None and error["error"]["code"] == "invalid_request"
        assert error["error"]["message"].startswith(f"line {number[custom_id]}: {part}: {reason}"), error["error"]

    by_id = {o["custom_id"]: o["response"]["body"] for o in outputs}

    def text(custom_id: str) -> str:
        body = by_id[custom_id]
        return body["choices"][0]["message"]["content"] if body["object"] == "chat.completion" else body["output"][0]["content"][0]["text"]

    assert text("red") != text("blue")  # the image decides the greedy answer
    assert text("red") == text("red-s3") == text("red-responses")  # wherever the same image comes from
    # Usage counts the image's tokens in the prompt, as vLLM counts them.
    from batch_pipeline_tests.support.tiny_vlm import IMAGE_SEQ_LEN

    prompt = {i: (b.get("usage") or {}).get("prompt_tokens", (b.get("usage") or {}).get("input_tokens")) for i, b in by_id.items()}
    assert prompt["red"] >= prompt["text"] + IMAGE_SEQ_LEN
    assert prompt["two"] >= prompt["red"] + IMAGE_SEQ_LEN
    assert prompt["red"] == prompt["red-s3"] == prompt["red-responses"]
    assert batch_obj["usage"]["input_tokens"] == sum(prompt.values())
    # Progress and the record count the images answered (5 lines, 6 images; failed lines' images not).
    inference = json.loads((out / "_work" / "inference.json").read_text())
    assert inference["images"] == 6 and 0 <= inference["image_wait_share"] < 1
    assert any("requests (100%), 6 images (" in m for m in messages), messages
    assert any("6 images; the engine waited on image preparation" in m for m in messages), messages


def test_a_prompt_its_images_make_longer_than_the_context_is_context_length_exceeded(vlm_dir, vlm_llm, tmp_path):
    """Only the model's processor counts image tokens, so such a prompt passes the text measure and
    vLLM refuses it when it is enqueued: that line is `context_length_exceeded`, as a text prompt
    over the context is, not vLLM's 400 text; the same text alone, and the images with a short
    text, are answered."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)

    def measured(text: str) -> int:  # as GenerationEngine._count_chat measures a chat's text
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    # Text of 509-511 tokens: under MAX_MODEL_LEN=512, and over it with two images (>= 4 tokens each).
    words = 400
    while measured("word " * words) < 509:
        words += 1
    text = "word " * words
    assert measured(text) <= 511, measured(text)
    red, blue = data_url(png("red")), data_url(png("blue"))
    lines = [line("long-with-images", chat_body(red, blue, text=text, max_tokens=4)),
             line("long-text", {"model": VLM, "messages": [{"role": "user", "content": text}], "max_tokens": 4}),
             line("short-with-images", chat_body(red, blue, max_tokens=4)),
             line("long-responses", responses_body(red, blue, text=text, max_output_tokens=4), RESPONSES)]
    batch = write_batch(tmp_path / "in", "long.jsonl", lines)
    out = tmp_path / "out"

    result, _ = run(vlm_llm, batch, out)
    assert result.success
    outputs, errors, batch_obj = read_results(out)
    answered_once(outputs, errors, ["long-with-images", "long-text", "short-with-images", "long-responses"])
    assert sorted(o["custom_id"] for o in outputs) == ["long-text", "short-with-images"]
    for error, number in zip(sorted(errors, key=lambda e: e["error"]["line"]), (1, 4)):
        assert error["response"] is None and error["error"]["code"] == "context_length_exceeded", error
        message = error["error"]["message"]
        prefix, _, rest = message.partition(" tokens with its images; ")
        assert prefix.startswith(f"line {number}: the prompt is ") and int(prefix.rsplit(" ", 1)[1]) > 512, message
        assert rest == "MAX_MODEL_LEN is 512, which leaves no room for output", message
    assert batch_obj["request_counts"] == {"total": 4, "completed": 2, "failed": 2}


class _InterruptedAfter:
    """The real engine, whose step() raises as a terminated Dagster step does after `steps` steps."""

    def __init__(self, llm: Any, steps: int):
        self._llm, self._left = llm, steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    @property
    def llm_engine(self) -> Any:
        outer = self

        class _Engine:
            def __getattr__(self, name: str) -> Any:
                return getattr(outer._llm.llm_engine, name)

            def step(self) -> Any:
                outer._left -= 1
                if outer._left < 0:
                    raise dg.DagsterExecutionInterruptedError("terminated from the UI")
                return outer._llm.llm_engine.step()

        return _Engine()


class InterruptedVLM(SessionLLM):
    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return _InterruptedAfter(super().build_engine(kwargs), steps=15)


def _counting_fetches(monkeypatch) -> list[str]:
    fetched: list[str] = []
    real = images.fetch_bytes

    def fetch(ref: images.ImageRef, settings: images.ImageSettings) -> bytes:
        fetched.append(ref.url)
        return real(ref, settings)

    monkeypatch.setattr(images, "fetch_bytes", fetch)
    return fetched


def test_a_resumed_run_fetches_only_the_images_of_lines_not_answered(vlm_llm, s3_bucket, tmp_path, monkeypatch):
    ids = [f"img-{i:02d}" for i in range(16)]
    urls = {}
    for n, custom_id in enumerate(ids):
        urls[custom_id] = f"s3://{s3_bucket}/{custom_id}.png"
        storage.write_bytes(urls[custom_id], png((n * 15, 255 - n * 15, 90)))
    # Short lines finish within the first steps, long ones are still running when the "terminate" comes.
    lines = [line(i, chat_body(urls[i], max_tokens=2 if n % 2 else 60, ignore_eos=True)) for n, i in enumerate(ids)]
    batch = write_batch(tmp_path / "in", "resume.jsonl", lines)
    out = tmp_path / "out"
    fetched = _counting_fetches(monkeypatch)

    interrupted = vlm_llm.rebuilt(InterruptedVLM, checkpoint_answers=2, order="input")
    first, _ = run(interrupted, batch, out)
    assert not first.success
    outputs, errors, batch_obj = read_results(out)
    assert batch_obj["status"] == "cancelled"
    answered = {o["custom_id"] for o in outputs}
    assert answered and len(answered) < len(ids), answered
    assert len(fetched) == len(set(fetched))  # each image fetched once in the run

    fetched.clear()
    second, messages = run(vlm_llm.rebuilt(order="input"), batch, out)
    assert second.success
    # Only the images of the lines left, each once: the answered lines' images are not fetched again.
    assert sorted(fetched) == sorted(urls[i] for i in ids if i not in answered)
    assert any(f"{len(answered)} of {len(ids)} requests already answered; resuming" in m for m in messages), messages
    outputs2, errors2, batch2 = read_results(out)
    answered_once(outputs2, errors2, ids)
    assert errors2 == [] and batch2["status"] == "completed"
    inference = json.loads((out / "_work" / "inference.json").read_text())
    assert inference["images"] == len(ids) - len(answered)


def test_an_image_heavy_batch_killed_with_sigkill_and_rerun_answers_every_line_once(vlm_dir, vlm_llm, s3_bucket,
                                                                                    tmp_path):
    # 160 lines of two images each, half on the S3 test server, half data URLs; output lengths
    # differ, so ORDER=planned feeds them out of file order in both runs.
    ids = [f"k-{i:03d}" for i in range(160)]
    for n in range(16):
        storage.write_bytes(f"s3://{s3_bucket}/p{n}.png", png((n * 16, 40, 255 - n * 16), (64 + n, 48)))
    lines = [line(i, chat_body(f"s3://{s3_bucket}/p{n % 16}.png", data_url(png((200, n % 256, 0), (40, 40 + n % 7))),
                               max_tokens=16 + (n * 7) % 33, ignore_eos=True))
             for n, i in enumerate(ids)]
    batch = write_batch(tmp_path / "in", "heavy.jsonl", lines)
    out = tmp_path / "out"
    env = {**os.environ, "MODEL_PATH": str(vlm_dir), "SERVED_MODEL_NAME": VLM, "MAX_MODEL_LEN": "512", "SEED": "0",
           "CHECKPOINT_ANSWERS": "10", "BATCH_SIZE": "16", "ORDER": "planned"}
    env.pop("DAGSTER_HOME", None)
    command = [str(Path(sys.executable).parent / "batch-pipeline"), "run", str(batch), "--output-dir", str(out)]

    saved = killed_after_parts(command, env, out)
    assert 0 < saved < len(ids)
    assert not (out / "batch.json").exists()

    # The rerun: run_batch in this process on the session's engine (a second CLI process only adds
    # a vLLM import and an engine build).
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    storage_resource = StorageResource(input_path=str(batch.parent), output_path=str(out))
    with dg.instance_for_test() as instance:
        second = run_batch(str(batch), str(out), today, resources={"llm": vlm_llm, "storage": storage_resource},
                           instance=instance)
        assert second.success
        messages = [str(r.user_message) for r in instance.all_logs(second.run_id)]
    assert any(f"{saved} of {len(ids)} requests already answered; resuming" in m for m in messages), messages
    outputs, errors, batch_obj = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and batch_obj["status"] == "completed"
    assert batch_obj["request_counts"] == {"total": len(ids), "completed": len(ids), "failed": 0}
    assert all(o["response"]["body"]["usage"]["prompt_tokens"] > 8 for o in outputs)


# ----------------------------------------------------------------------------- tables with an image column


def _row_line(row: dict, base: str, number: int = 1) -> dict:
    from batch_pipeline.io import table_inputs

    return json.loads(table_inputs.request_line(row, number, VLM, table_inputs.ImageColumn("photo", base)))


def test_an_image_column_puts_each_rows_images_in_its_user_message(tmp_path):

    red = png("red")
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(red)

    def parts(row: dict, base: str = str(tmp_path)) -> list:
        return _row_line(row, base)["body"]["messages"][-1]["content"]

    assert parts({"prompt": "what", "photo": red}) == [
        {"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": data_url(red)}}]
    assert parts({"prompt": "what", "photo": "imgs/red.png"})[1]["image_url"]["url"] == data_url(red)
    assert parts({"prompt": "what", "photo": "s3://b/k.png"})[1]["image_url"]["url"] == "s3://b/k.png"
    assert parts({"prompt": "what", "photo": "https://img.example.com/a.png"})[1]["image_url"]["url"] == (
        "https://img.example.com/a.png")
    # A path next to a table on S3 is the object beside it.
    assert parts({"prompt": "what", "photo": "imgs/red.png"}, "s3://b/tables")[1]["image_url"]["url"] == (
        "s3://b/tables/imgs/red.png")
    assert [p["type"] for p in parts({"prompt": "what", "photo": [red, "s3://b/k.png"]})] == ["text", "image_url", "image_url"]
    assert parts({"prompt": "what", "photo": None}) == "what"  # no image: the text row it always was
    # With a messages column: into the last user message.
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "this one"}]
    body = _row_line({"messages": messages, "photo": red}, str(tmp_path))["body"]
    assert body["messages"][1]["content"] == "first"
    assert body["messages"][3]["content"][1]["type"] == "image_url"


@pytest.mark.parametrize("value, reason", [
    ("/etc/passwd", "'/etc/passwd' is not a path inside the table's folder"),
    ("../outside.png", "'../outside.png' is not a path inside the table's folder"),
    ("file:///etc/passwd", "is not a path inside the table's folder"),
    ("imgs/missing.png", "cannot read 'imgs/missing.png' next to the table"),
    (42, "must hold image bytes, a URI or a path, got int"),
])
def test_an_image_cell_that_cannot_be_used_is_the_rows_error(tmp_path, value, reason):
    from batch_pipeline.io import table_inputs

    with pytest.raises(table_inputs.RowError) as err:
        _row_line({"prompt": "what", "photo": value}, str(tmp_path), number=7)
    assert str(err.value).startswith("row 7: column `photo`") and reason in str(err.value), str(err.value)


def test_a_table_without_the_named_image_column_fails_the_batch(tmp_path, vision_folder, monkeypatch):
    import dataclasses

    import pandas as pd

    from batch_pipeline.steps.ingest import validate_table

    monkeypatch.delenv("MODELS_FILE", raising=False)
    table = tmp_path / "t.parquet"
    pd.DataFrame({"prompt": ["a"]}).to_parquet(table)
    settings = dataclasses.replace(LLMResource(model_path=str(vision_folder), served_model_name=VLM).validation_settings(),
                                   image_column="photo")
    summary = validate_table(str(table), settings, lambda _v: None, lambda _i: None)
    error = summary.file_error()
    assert error.code == "unreadable_file"
    assert error.message == "t.parquet: the image column `photo` (batch.image_column) is not a column of this table"


def test_parquet_with_an_image_column_runs_on_the_vision_model(vlm_llm, s3_bucket, tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batch_pipeline_tests.support.asset_runs import DATE, materialize

    red, blue = png("red"), png("blue")
    inbox, out = tmp_path / "in", tmp_path / "out"
    (inbox / DATE / "imgs").mkdir(parents=True)
    (inbox / DATE / "imgs" / "red.png").write_bytes(red)
    storage.write_bytes(f"s3://{s3_bucket}/red.png", red)
    # One table of image bytes, one of paths and URIs: a column holds one type.
    greedy = {"max_tokens": [8] * 4, "temperature": [0.0] * 4}
    pq.write_table(pa.table({"prompt": ["describe"] * 3, "photo": pa.array([red, blue, None], pa.binary()),
                             "sku": [1, 2, 3], **{k: v[:3] for k, v in greedy.items()}}), inbox / DATE / "by_bytes.parquet")
    pq.write_table(pa.table({"prompt": ["describe"] * 4, "photo": ["imgs/red.png", f"s3://{s3_bucket}/red.png",
                                                                    "imgs/none.png", data_url(blue)],
                             "sku": [4, 5, 6, 7], **greedy}), inbox / DATE / "by_uri.parquet")
    config = {"resources": {"batch": {"config": {"image_column": "photo"}}}}
    result = materialize(vlm_llm, str(inbox), str(out), run_config=config)
    assert result.success

    by_bytes = pd.read_parquet(out / DATE / "by_bytes" / "results.parquet")
    by_uri = pd.read_parquet(out / DATE / "by_uri" / "results.parquet")
    assert "photo" not in by_bytes.columns and list(by_bytes["sku"]) == [1, 2, 3]  # images are not carried through
    assert list(by_bytes["status"]) == ["completed"] * 3 and list(by_uri["status"]) == ["completed", "completed", "failed", "completed"]
    red_answer, blue_answer, text_answer = by_bytes["content"]
    assert red_answer != blue_answer
    assert list(by_uri["content"][[0, 1, 3]]) == [red_answer, red_answer, blue_answer]
    assert by_bytes["prompt_tokens"][0] > by_bytes["prompt_tokens"][2]  # the image's tokens
    assert by_uri["error_code"][2] == "invalid_request"
    assert by_uri["error_message"][2].startswith("row 3: column `photo`: cannot read 'imgs/none.png' next to the table")


@pytest.mark.usefixtures("sensor_env")
def test_the_upload_sensor_runs_an_image_table_by_table_image_column(vlm_llm, s3_bucket, monkeypatch):
    """The sensor's runs name no image column: with TABLE_IMAGE_COLUMN=image, a table uploaded with
    a column `image` has its images taken from it (paths beside the table on S3, and bytes), and a
    text table found in the same tick runs as text; each table is its own file run, which says which
    column it took."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batch_pipeline.defs.batch_files import batch_files
    from batch_pipeline.defs.resources import BatchSelection
    from batch_pipeline_tests.support.asset_runs import DATE
    from batch_pipeline_tests.support.sensor_ticks import evaluate, turned_on

    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")  # DATE is fixed; the default window follows today
    monkeypatch.setenv("TABLE_IMAGE_COLUMN", "image")
    inbox = f"s3://{s3_bucket}/incoming"
    store = StorageResource(input_path=inbox, output_path=f"s3://{s3_bucket}/output")
    on = turned_on(store)
    red, blue = png("red"), png("blue")
    storage.write_bytes(f"{inbox}/{DATE}/imgs/red.png", red)
    greedy = {"max_tokens": [8] * 3, "temperature": [0.0] * 3}
    catalogue = pa.table({"prompt": ["describe"] * 3, "image": ["imgs/red.png", data_url(blue), None],
                          "sku": [1, 2, 3], **greedy})
    photos = pa.table({"prompt": ["describe"], "image": pa.array([red], pa.binary()), "max_tokens": [8],
                       "temperature": [0.0]})
    for name, table in (("catalogue", catalogue), ("photos", photos)):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        storage.write_bytes(f"{inbox}/{DATE}/{name}.parquet", sink.getvalue().to_pybytes())
    storage.write_bytes(f"{inbox}/{DATE}/tickets.csv", b"prompt,max_tokens,image_caption\ndescribe,8,a red square\n")

    requests = evaluate(store, on).run_requests  # one run per table
    assert sorted(r.partition_key for r in requests) == [f"{DATE}/{n}" for n in ("catalogue", "photos", "tickets")]
    messages = []
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("batch_files", [r.partition_key for r in requests])
        for request in requests:
            assert "image_column" not in str(request.run_config)  # the run names no column
            result = dg.materialize([batch_files], partition_key=request.partition_key, run_config=request.run_config or None,
                                    raise_on_error=False, instance=instance,
                                    resources={"batch": BatchSelection(), "llm": vlm_llm, "storage": store})
            assert result.success, request.partition_key
            messages += [str(r.user_message) for r in instance.all_logs(result.run_id)]
    assert any("catalogue: images from its column `image` (TABLE_IMAGE_COLUMN)" in m for m in messages), messages
    assert not any("tickets: images from" in m for m in messages)

    def results(name: str) -> pd.DataFrame:
        return pq.read_table(pa.BufferReader(storage.read_bytes(f"s3://{s3_bucket}/output/{DATE}/{name}/results.parquet"))).to_pandas()

    by_sensor, photo, text = results("catalogue"), results("photos"), results("tickets")
    assert list(by_sensor["status"]) == ["completed"] * 3 and list(photo["status"]) == ["completed"]
    assert "image" not in by_sensor.columns and list(by_sensor["sku"]) == [1, 2, 3]
    red_answer, blue_answer, no_image = by_sensor["content"]
    assert red_answer != blue_answer and photo["content"][0] == red_answer  # the images reached the model
    assert by_sensor["prompt_tokens"][0] > by_sensor["prompt_tokens"][2]
    # The text table, which has no `image` column, ran as text (not unreadable_file).
    assert list(text["status"]) == ["completed"] and list(text["image_caption"]) == ["a red square"]
    validation = json.loads(storage.read_bytes(f"s3://{s3_bucket}/output/{DATE}/catalogue/_work/validation.json"))
    assert validation["image_column"] == "image"
    assert "image_column" not in json.loads(storage.read_bytes(f"s3://{s3_bucket}/output/{DATE}/tickets/_work/validation.json"))


def test_batch_pipeline_run_takes_a_tables_image_column(vlm_dir, tmp_path):
    """`batch-pipeline run TABLE --image-column photo`, the real command in its own process (its own
    vLLM import and engine): each CSV row's image, a path beside the table or a data URL, reaches
    the model; a row with an empty cell runs as text."""
    import pandas as pd

    from batch_pipeline_tests.support.tiny_vlm import IMAGE_SEQ_LEN

    red, blue = png("red"), png("blue")
    (tmp_path / "in" / "imgs").mkdir(parents=True)
    (tmp_path / "in" / "imgs" / "red.png").write_bytes(red)
    (tmp_path / "in" / "imgs" / "blue.png").write_bytes(blue)
    table = tmp_path / "in" / "catalogue.csv"
    pd.DataFrame({"prompt": ["describe"] * 4, "photo": ["imgs/red.png", "imgs/blue.png", data_url(red), ""],
                  "sku": ["s1", "s2", "s3", "s4"], "max_tokens": [8] * 4, "temperature": [0] * 4}).to_csv(table, index=False)
    out = tmp_path / "out"
    env = {**os.environ, "MODEL_PATH": str(vlm_dir), "SERVED_MODEL_NAME": VLM, "MAX_MODEL_LEN": "512", "SEED": "0",
           "KV_CACHE_MEMORY_BYTES": str(64 * 2**20)}
    env.pop("DAGSTER_HOME", None)
    command = [str(Path(sys.executable).parent / "batch-pipeline"), "run", str(table), "--output-dir", str(out),
               "--image-column", "photo"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 requests, 4 completed, 0 failed" in proc.stdout, proc.stdout
    results = pd.read_parquet(out / "results.parquet")
    assert "photo" not in results.columns and list(results["sku"]) == ["s1", "s2", "s3", "s4"]
    red_path, blue_path, red_data, text_only = results["content"]
    assert red_path != blue_path  # the image decides the greedy answer
    assert red_path == red_data  # the same picture from a path beside the table and from a data URL
    tokens = list(results["prompt_tokens"])
    assert tokens[0] == tokens[1] == tokens[2] >= tokens[3] + IMAGE_SEQ_LEN  # the image's tokens, in the usage


def test_batch_pipeline_run_image_column_is_for_tables_and_must_be_there(tmp_path, monkeypatch, capsys):
    """No engine is built: a JSONL input is refused before the run, and a table without the named
    column fails its batch in validation (the model is never loaded for a batch without valid lines)."""
    import pandas as pd

    from batch_pipeline.cli.main import EXIT_FAILED, main

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    jsonl = tmp_path / "lines.jsonl"
    jsonl.write_text(line("a", chat_body(data_url(png()))) + "\n")
    assert main(["run", str(jsonl), "--output-dir", str(tmp_path / "o1"), "--image-column", "photo"]) == EXIT_FAILED
    assert "--image-column is for Parquet/CSV inputs" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists()

    table = tmp_path / "t.csv"
    pd.DataFrame({"prompt": ["describe"], "picture": ["imgs/a.png"]}).to_csv(table, index=False)
    out = tmp_path / "o2"
    assert main(["run", str(table), "--output-dir", str(out), "--image-column", "photo"]) == EXIT_FAILED
    reason = "t.csv: the image column `photo` (batch.image_column) is not a column of this table"
    assert reason in capsys.readouterr().err
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "unreadable_file"


# ----------------------------------------------------------------------------- the stream's images ahead


def test_images_load_ahead_in_order_and_an_interrupted_stream_does_not_wait_on_a_slow_host():
    from batch_pipeline.engine.generation import NOTHING_YET, EngineClock, _images_ahead

    silent = socket.socket()  # accepts connections, never answers: a host that hangs
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        settings = images.ImageSettings(allowed_hosts=("127.0.0.1",), timeout_seconds=20, concurrency=2)
        reqs = [contract.BatchRequest(line=1, custom_id="a", url=CHAT, body=chat_body(data_url(png("red")))),
                contract.BatchRequest(line=2, custom_id="b", url=CHAT, body={"model": VLM, "messages": [
                    {"role": "user", "content": "text"}]}),
                contract.BatchRequest(line=3, custom_id="c", url=CHAT, body=chat_body(f"https://127.0.0.1:{port}/a.png"))]
        clock = EngineClock()
        busy = [False]
        stream = _images_ahead(iter(reqs), lambda: images.ImageResolver(settings), lambda: busy[0], clock)
        first, loaded = next(stream)
        assert first.custom_id == "a" and loaded.images[0].size == (80, 60)
        second, loaded = next(stream)
        assert second.custom_id == "b" and loaded is None
        busy[0] = True  # the engine holds work: the hanging line's turn is not waited for
        assert next(stream) is NOTHING_YET
        started = time.monotonic()
        stream.close()  # a terminate: the stream ends while the fetch hangs
        assert time.monotonic() - started < 2
    finally:
        silent.close()


def test_batch_pipeline_validate_takes_a_tables_image_column(tmp_path, vision_folder, monkeypatch, capsys):
    """`batch-pipeline validate TABLE --image-column photo` checks each row's image as the run would,
    without fetching or decoding it; without the flag the rows are text; JSONL is refused."""
    import pandas as pd

    from batch_pipeline.cli import main as cli

    for var in ("MODELS_FILE", "LORA_MODULES", "TABLE_IMAGE_COLUMN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MODEL_PATH", str(vision_folder))
    monkeypatch.setenv("SERVED_MODEL_NAME", VLM)
    table = tmp_path / "t.csv"
    pd.DataFrame({"prompt": ["a", "b"], "photo": [data_url(image_data.png("red")), "data:image/png;base64,@@@@"]}).to_csv(
        table, index=False)

    assert cli.main(["validate", str(table), "--image-column", "photo"]) == 1
    out = capsys.readouterr().out
    assert "2 requests: 1 valid, 1 invalid" in out
    [bad] = [line for line in out.splitlines() if line.startswith("  line ")]
    assert bad.startswith("  line 2 [invalid_request]") and "image_url" in bad and "base64" in bad, bad

    assert cli.main(["validate", str(table)]) == 0  # no image column named: two text rows
    assert "2 requests: 2 valid, 0 invalid" in capsys.readouterr().out
    assert cli.main(["validate", str(table), "--image-column", "nope"]) == 1
    assert "the batch would fail: t.csv: the image column `nope`" in capsys.readouterr().out
    # The command as a user runs it: its own process, which must exit with the same verdict.
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "validate", str(table),
                           "--image-column", "photo"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "2 requests: 1 valid, 1 invalid" in proc.stdout, proc.stdout + proc.stderr
    lines = tmp_path / "b.jsonl"
    lines.write_text("{}\n")
    assert cli.main(["validate", str(lines), "--image-column", "photo"]) == 2
    assert "--image-column is for Parquet/CSV inputs" in capsys.readouterr().err

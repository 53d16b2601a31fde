"""io/images.py: finding image parts in chat and Responses bodies, fetching and decoding them, limits,
and the checks validation makes without fetching or decoding (check_line), against the run's own.

Real files throughout: PNGs and JPEGs drawn with PIL in the test (none stored), data: URLs, objects
on the repo's S3 test server (moto over HTTP, with the pipeline's storage client), and a refused
connection for an allowed https:// host. No engine and no Dagster: what the model does with the
images is test_images_model.py; how the pipeline runs lines is not touched here.
"""

from __future__ import annotations

import base64
import socket
import time

import pytest

from batch_pipeline.io import images, storage
from batch_pipeline.contract import CHAT_URL, RESPONSES_URL
from batch_pipeline.io.images import ImageError, ImageRef, ImageResolver, ImageSettings
from batch_pipeline.config.settings import ConfigError
from batch_pipeline_tests.support.image_data import data_url, png
from batch_pipeline_tests.support.s3_server import moto_server, s3_bucket, s3_env  # noqa: F401


def chat(*parts: dict, text: str = "describe") -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


WHERE = "body.messages[1].content[1].image_url"


def load(url: str, settings: ImageSettings = ImageSettings()):
    return images.load_image(ImageRef(WHERE, url), settings)


# ----------------------------------------------------------------------------- where images are


def test_chat_and_responses_parts_are_found_with_their_places():
    body = chat(image_part("data:a"), image_part("s3://b/k.png"))
    assert images.image_refs(CHAT_URL, body) == [
        ImageRef("body.messages[1].content[1].image_url", "data:a"),
        ImageRef("body.messages[1].content[2].image_url", "s3://b/k.png"),
    ]
    responses = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this"}, {"type": "input_image", "image_url": "s3://b/x.jpg", "detail": "low"}]}]}
    assert images.image_refs(RESPONSES_URL, responses) == [ImageRef("body.input[0].content[1].image_url", "s3://b/x.jpg")]
    assert images.image_refs(CHAT_URL, {"messages": [{"role": "user", "content": "text only"}]}) == []
    assert images.image_refs(RESPONSES_URL, {"input": "text only"}) == []


@pytest.mark.parametrize("body, url, where, reason", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, CHAT_URL,
     "body.messages[0].content[0].image_url", "needs a url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, RESPONSES_URL,
     "body.input[0].content[0].file_id", "file ids are not supported"),
])
def test_a_part_without_a_usable_url_names_itself(body, url, where, reason):
    with pytest.raises(ImageError) as err:
        images.image_refs(url, body)
    assert err.value.where == where and reason in str(err.value)


def test_too_many_images_names_the_first_one_over():
    refs = images.image_refs(CHAT_URL, chat(*[image_part(data_url(png())) for _ in range(3)]))
    with pytest.raises(ImageError) as err:
        images.check_count(refs, ImageSettings(max_images_per_request=2))
    assert err.value.where == "body.messages[1].content[3].image_url"
    assert "3 images in one request, more than MAX_IMAGES_PER_REQUEST=2" in str(err.value)


# ----------------------------------------------------------------------------- data: URLs and decoding


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_data_urls_decode_to_rgb(fmt, mime):
    image = load(data_url(png("blue", (33, 21), fmt=fmt), mime))
    assert image.mode == "RGB" and image.size == (33, 21)


def _bomb() -> bytes:
    # 10000 x 10000 one-bit pixels: about 12 KB as PNG, 100 megapixels (300 MB as RGB) decoded.
    return png(0, (10000, 10000), mode="1")


@pytest.mark.parametrize("url, reason", [
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    (data_url(b"plain text, not an image"), "not an image format that can be read"),
    (data_url(png()[:60]), "damaged"),
    ("http://example.com/a.png", "unsupported image url"),
    ("file:///etc/passwd", "unsupported image url"),
    ("ftp://h/a.png", "unsupported image url"),
])
def test_bad_images_are_errors_naming_the_part(url, reason):
    with pytest.raises(ImageError) as err:
        load(url)
    assert str(err.value).startswith(WHERE + ": ") and reason in str(err.value)


def test_byte_limit_before_and_after_decoding_base64():
    data = png("red", (200, 200), fmt="BMP")  # BMP: incompressible size, 120 KB
    with pytest.raises(ImageError, match="larger than MAX_IMAGE_BYTES=1000"):
        load(data_url(data, "image/bmp"), ImageSettings(max_image_bytes=1000))
    assert load(data_url(data, "image/bmp"), ImageSettings(max_image_bytes=len(data))).size == (200, 200)


def test_pixel_limit_refuses_a_decompression_bomb_before_decoding():
    bomb = _bomb()
    assert len(bomb) < 64 * 1024
    started = time.monotonic()
    with pytest.raises(ImageError, match=r"10000x10000 pixels, more than MAX_IMAGE_PIXELS=50000000"):
        load(data_url(bomb))
    assert time.monotonic() - started < 2  # header only: decoding 100 Mpx would take longer
    with pytest.raises(ImageError, match="more than MAX_IMAGE_PIXELS=1000"):
        load(data_url(png("red", (40, 30))), ImageSettings(max_image_pixels=1000))


@pytest.mark.parametrize("url", [data_url(png(), "text/plain"), data_url(png(), "application/json"),
                                 "data:;base64," + data_url(png()).split(",", 1)[1]])
def test_a_data_url_that_says_it_is_not_an_image_is_refused_whatever_it_holds(url):
    with pytest.raises(ImageError, match="a data: URL image must have an image media type") as err:
        load(url)
    assert str(err.value).startswith(WHERE + ": ")
    # Bytes whose type is not said (a table's image bytes of a format it does not recognise) are
    # read by content.
    assert load(data_url(png(), "application/octet-stream")).size == (40, 30)


# Strict base64 (binascii's strict_mode, which b64decode(validate=True) is) takes "AAAA====" and
# "AAAA=" and refuses "AB==AB==", "AA=A" and "====": the chunked check must agree on each.
PAYLOADS = ["", "=", "====", "AAAA", "AAA=", "AA==", "A===", "AAA", "AAAAA", "AA=A", "AAAA=", "AAAA==", "AAAA====",
            "AAAA====A", "AAAA==A", "AB==AB==", "AA AA", "AAAA\nAAAA", "AAAAAAAA", "AAAAAAA=", "AAAAAA==", "AAAA=AAA",
            "AA==AAAA", "AAAAAAAAAAA=", "AAAAAAAAA===", "AAAAAAAA====", "AAAAAAAAAAAA=AAAAAAAA", "AAAA*AAA",
            "AAAAAAAAAAAA*", "é" * 8, "AAAAAAAAé", base64.b64encode(png()).decode(), base64.b64encode(png()[:-1]).decode()]


@pytest.mark.parametrize("chunk", [4, 8, 12, images.BASE64_CHECK_CHARS])
def test_base64_checked_in_chunks_agrees_with_decoding_it_whole(chunk):
    """Validation checks a data: URL's base64 a chunk at a time, dropping the decoded bytes; its
    verdict and size are those of decoding it whole, as the run does."""
    for payload in PAYLOADS:
        try:
            whole = len(base64.b64decode(payload, validate=True))
        except ValueError:
            whole = None
        assert images._base64_size(payload, chunk) == whole, (payload, chunk)


@pytest.mark.parametrize("url, settings", [
    ("data:image/png;base64,@@not base64@@", ImageSettings()),
    ("data:image/png;base64,AAAA=AAA", ImageSettings()),
    ("data:image/png,rawbytes", ImageSettings()),
    (data_url(png(), "text/plain"), ImageSettings()),
    (data_url(png("red", (200, 200), fmt="BMP"), "image/bmp"), ImageSettings(max_image_bytes=1000)),
    (data_url(b"x" * 1001, "image/png"), ImageSettings(max_image_bytes=1000)),
    ("http://example.com/a.png", ImageSettings()),
    ("file:///etc/passwd", ImageSettings()),
    ("https://images.example.com/a.png", ImageSettings()),
    ("https://evil.example/a.png", ImageSettings(allowed_hosts=("images.example.com",))),
    ("https://[oops/a.png", ImageSettings(allowed_hosts=("images.example.com",))),
    ("s3:///a.png", ImageSettings()),
])
def test_validation_finds_without_fetching_what_the_run_would_refuse_with_its_message(url, settings):
    """check_line (validation) raises the very ImageError the run's load gives, and fetches nothing."""
    with pytest.raises(ImageError) as run:
        load(url, settings)
    with pytest.raises(ImageError) as validation:
        images.check_line(CHAT_URL, chat(image_part(url)), settings)
    assert str(validation.value) == str(run.value)


def test_validation_passes_what_needs_a_fetch_or_a_decode_to_judge(monkeypatch):
    def no_io(*args):
        raise AssertionError("validation fetched or decoded an image")

    for name in ("decode", "_s3_bytes", "_https_bytes"):
        monkeypatch.setattr(images, name, no_io)
    settings = ImageSettings(allowed_hosts=("images.example.com",))
    body = chat(image_part(data_url(b"plain text, not an image")), image_part("s3://no-such-bucket-for-images/a.png"),
                image_part("https://images.example.com/a.png"), image_part(data_url(png()[:60])))
    images.check_line(CHAT_URL, body, settings)  # each is the run's to find: not an image, missing, unreachable, damaged
    # The count is checked first, naming the first part over it, as the run does.
    with pytest.raises(ImageError, match=r"content\[3\].image_url: 4 images in one request, more than MAX_IMAGES_PER_REQUEST=2"):
        images.check_line(CHAT_URL, body, ImageSettings(max_images_per_request=2))
    responses = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://h/a.png"}]}]}
    with pytest.raises(ImageError, match=r"^body.input\[0\].content\[0\].image_url: unsupported image url"):
        images.check_line(RESPONSES_URL, responses, settings)


# ----------------------------------------------------------------------------- S3 and https


def test_s3_objects_read_with_the_pipelines_credentials(s3_bucket):
    data = png("green", (25, 35), fmt="JPEG")
    storage.write_bytes(f"s3://{s3_bucket}/imgs/a.jpg", data)
    from_s3 = load(f"s3://{s3_bucket}/imgs/a.jpg")
    from_data_url = load(data_url(data, "image/jpeg"))
    assert from_s3.size == (25, 35) and from_s3.tobytes() == from_data_url.tobytes()
    with pytest.raises(ImageError, match=f"no such S3 object: s3://{s3_bucket}/imgs/missing.png"):
        load(f"s3://{s3_bucket}/imgs/missing.png")
    with pytest.raises(ImageError, match="no such S3 object"):
        load("s3://no-such-bucket-for-images/a.png")
    with pytest.raises(ImageError, match="larger than MAX_IMAGE_BYTES=100"):
        load(f"s3://{s3_bucket}/imgs/a.jpg", ImageSettings(max_image_bytes=100))


def test_https_only_from_allowed_hosts():
    with pytest.raises(ImageError, match=r"from images.example.com are not allowed \(IMAGE_URL_ALLOWED_HOSTS: none\)"):
        load("https://images.example.com/a.png")
    with pytest.raises(ImageError, match="from evil.example are not allowed"):
        load("https://evil.example/a.png", ImageSettings(allowed_hosts=("images.example.com",)))


def test_an_allowed_host_that_does_not_answer_is_the_lines_error_after_retries():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ImageSettings(allowed_hosts=("127.0.0.1",), timeout_seconds=2)
    started = time.monotonic()
    with pytest.raises(ImageError, match="could not fetch the image from 127.0.0.1"):
        load(f"https://127.0.0.1:{port}/a.png", settings)
    assert time.monotonic() - started < 10


# ----------------------------------------------------------------------------- many lines


def test_resolver_keeps_order_and_loses_nothing_but_the_bad_line(s3_bucket):
    storage.write_bytes(f"s3://{s3_bucket}/a.png", png("white", (20, 20)))
    lines = [
        (1, CHAT_URL, chat(image_part(data_url(png("red"))))),
        (2, CHAT_URL, chat(image_part(f"s3://{s3_bucket}/missing.png"))),
        (3, CHAT_URL, {"messages": [{"role": "user", "content": "no image"}]}),
        (4, CHAT_URL, chat(image_part(f"s3://{s3_bucket}/a.png"), image_part(data_url(png("blue"))))),
        (5, CHAT_URL, chat(*[image_part(data_url(png())) for _ in range(3)])),
        (6, RESPONSES_URL, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]}),
    ]
    with ImageResolver(ImageSettings(concurrency=2, max_images_per_request=2)) as resolver:
        out = list(resolver.resolve_all(lines, window=2))
    assert [r.line for r in out] == [1, 2, 3, 4, 5, 6]
    assert [len(r.images) for r in out] == [1, 0, 0, 2, 0, 0]
    assert out[3].images[0].size == (20, 20) and out[3].images[1].size == (40, 30)
    assert [str(r.error) if r.error else None for r in out] == [
        None,
        f"{WHERE}: no such S3 object: s3://{s3_bucket}/missing.png",
        None,
        None,
        "body.messages[1].content[3].image_url: 3 images in one request, more than MAX_IMAGES_PER_REQUEST=2",
        "body.input[0].content[0].image_url: a data: URL image must be base64 (data:image/png;base64,...)",
    ]
    assert resolver.images_loaded == 3


# ----------------------------------------------------------------------------- settings


def test_settings_from_the_environment():
    assert images.image_settings_from_env({}) == ImageSettings()
    s = images.image_settings_from_env({
        "MAX_IMAGE_BYTES": "1024", "MAX_IMAGE_PIXELS": "4096", "MAX_IMAGES_PER_REQUEST": "3",
        "IMAGE_FETCH_CONCURRENCY": "2", "IMAGE_FETCH_TIMEOUT": "5", "IMAGE_URL_ALLOWED_HOSTS": " Img.Example.com, cdn.example.org ",
    })
    assert s == ImageSettings(1024, 4096, 3, ("img.example.com", "cdn.example.org"), 2, 5.0)


@pytest.mark.parametrize("env, names", [
    ({"MAX_IMAGE_BYTES": "0"}, "MAX_IMAGE_BYTES"),
    ({"MAX_IMAGES_PER_REQUEST": "many"}, "MAX_IMAGES_PER_REQUEST"),
    ({"IMAGE_URL_ALLOWED_HOSTS": "https://img.example.com"}, "IMAGE_URL_ALLOWED_HOSTS"),
    ({"IMAGE_URL_ALLOWED_HOSTS": "*.example.com"}, "IMAGE_URL_ALLOWED_HOSTS"),
])
def test_bad_settings_name_the_variable(env, names):
    with pytest.raises(ConfigError, match=names):
        images.image_settings_from_env(env)


# ----------------------------------------------------------------------------- models and validation


def _line(body: dict, url: str = CHAT_URL) -> bytes:
    import json

    return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": body}).encode()


@pytest.mark.parametrize("url, body, where", [
    (CHAT_URL, {**chat(image_part("s3://b/a.png")), "model": "served"}, "body.messages[1].content[1].image_url"),
    (RESPONSES_URL, {"model": "served", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
     "body.input[0].content[0].image_url"),
    (RESPONSES_URL, {"model": "served", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "body.input[0].content[0].file_id"),
])
def test_a_text_only_model_refuses_image_parts_per_line_naming_the_model(url, body, where):
    from batch_pipeline.steps.validation import InvalidLine, LineValidator, ValidationSettings

    result = LineValidator(ValidationSettings("served")).validate(7, _line(body, url))
    assert isinstance(result, InvalidLine) and result.code == "invalid_request"
    assert result.message == f"line 7: {where}: 'served' does not take images (a text-only model)"


def test_text_lines_are_untouched_by_the_image_check():
    from batch_pipeline.steps.validation import LineValidator, ValidLine, ValidationSettings

    validator = LineValidator(ValidationSettings("served"))
    assert isinstance(validator.validate(1, _line({"model": "served", "messages": [{"role": "user", "content": "hi"}]})), ValidLine)


@pytest.mark.engine
def test_doctor_and_models_say_whether_the_model_takes_images(tmp_path, monkeypatch):
    import json

    from batch_pipeline.cli import doctor
    from batch_pipeline.config import models
    from batch_pipeline_tests.support.tiny_vlm import build_tiny_vlm

    vlm = build_tiny_vlm(models.cache_root() / "test-models" / "tiny-idefics3")
    assert models.takes_images(vlm)
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert not models.takes_images(text_only) and not models.takes_images(tmp_path / "nothing")
    monkeypatch.setenv("MODEL_PATH", str(vlm))
    result = doctor.check_model()
    assert result.ok and not result.warning, result.detail
    assert "Idefics3ForConditionalGeneration, takes images" in result.detail

"""Images of a batch line: where they are in the body, fetched and decoded ahead of the engine.

A chat line carries images as content parts `{"type": "image_url", "image_url": {"url", "detail"}}`,
a Responses line as `input_image` items in a message's content (`image_url` a string). The url is
a `data:` URL (base64), an `s3://` object read with the pipeline's own storage credentials
(io/storage.py: its client, retries and timeouts), or `https://` on a host the operator allows
(IMAGE_URL_ALLOWED_HOSTS, none by default: the pipeline makes no request to a host a batch names).

Every bad image is an ImageError naming the part (`body.messages[0].content[1].image_url`) and the
reason; the caller turns it into that line's error, nothing else is lost. Limits are checked before
the work they bound: the byte limit while reading (never more than MAX_IMAGE_BYTES + 1 bytes in
memory), the pixel limit from the image header before any pixel is decoded (a decompression bomb is
refused before it expands), the image count before anything is fetched.

`check_line` makes the checks that need no fetch and no decode (the count, the scheme, an https
host against the allowed ones, a data: URL's media type, base64 and size), for validation, so a bad
line is found before the run; they are the same functions the run calls, giving the same messages.

`ImageResolver.resolve_all` fetches the images of many lines on a bounded thread pool and yields
each line's decoded images (PIL, RGB) in input order, a bounded window ahead of the consumer, so the
engine is fed while the next lines' images are still on the wire. Dagster-free.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batch_pipeline.base.env import int_in_range, number_in_range, read_text
from batch_pipeline.base.errors import ConfigError
from batch_pipeline.contract.common import CHAT_URL, RESPONSES_URL
from batch_pipeline.io import storage

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # OpenAI's documented per-image limit
# 50 megapixels: a 7000 x 7000 photo passes; a PNG that claims 100000 x 100000 (a few KB on disk,
# 30 GB decoded) does not. PIL's own bomb guard (89 Mpx warning, 179 Mpx error) is a process global.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
DEFAULT_IMAGE_FETCH_CONCURRENCY = 8
DEFAULT_IMAGE_FETCH_TIMEOUT = 30.0
# HTTPS attempts, first included (S3 reads retry inside botocore, AWS_MAX_ATTEMPTS).
HTTPS_ATTEMPTS = 3
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class ImageError(ValueError):
    """One image that cannot be used; `where` names the part, the message says why."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class ImageSettings:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    allowed_hosts: tuple[str, ...] = ()  # lower-case host names; empty: no https:// images
    concurrency: int = DEFAULT_IMAGE_FETCH_CONCURRENCY
    timeout_seconds: float = DEFAULT_IMAGE_FETCH_TIMEOUT


def image_settings_from_env(env: Mapping[str, str] | None = None) -> ImageSettings:
    """The image limits from the environment (docs/CONFIGURATION.md); ConfigError naming a bad variable."""
    ints = {
        "max_image_bytes": int_in_range(env, "MAX_IMAGE_BYTES", 1, 2**31),
        "max_image_pixels": int_in_range(env, "MAX_IMAGE_PIXELS", 1, 2**31),
        "max_images_per_request": int_in_range(env, "MAX_IMAGES_PER_REQUEST", 1, 1024),
        "concurrency": int_in_range(env, "IMAGE_FETCH_CONCURRENCY", 1, 256),
    }
    values: dict[str, Any] = {k: v for k, v in ints.items() if v is not None}
    timeout = number_in_range(env, "IMAGE_FETCH_TIMEOUT", 0, 3600, " seconds", above_low=True)
    if timeout is not None:
        values["timeout_seconds"] = timeout
    hosts = [h.strip().lower() for h in read_text(env, "IMAGE_URL_ALLOWED_HOSTS").split(",") if h.strip()]
    for host in hosts:
        if "/" in host or ":" in host or "*" in host:
            raise ConfigError(f"IMAGE_URL_ALLOWED_HOSTS: {host!r} is not a host name (no scheme, port, path or wildcard)")
    return ImageSettings(allowed_hosts=tuple(hosts), **values)


# ------------------------------------------------------------------------------- where images are


@dataclass(frozen=True)
class ImageRef:
    where: str  # the part, as error messages name it: body.messages[0].content[1].image_url
    url: str


def image_refs(url: str, body: Mapping[str, Any]) -> list[ImageRef]:
    """The images a line's body carries, in order; ImageError for a part that names none usably."""
    refs: list[ImageRef] = []
    if url == CHAT_URL:
        for i, message in enumerate(_list(body.get("messages"))):
            for j, part in enumerate(_parts(message)):
                if part.get("type") == "image_url":
                    where = f"body.messages[{i}].content[{j}].image_url"
                    image = part.get("image_url")
                    target = image.get("url") if isinstance(image, dict) else image
                    refs.append(ImageRef(where, _url_string(where, target)))
    elif url == RESPONSES_URL:
        items = body.get("input")
        for i, item in enumerate(_list(items)):
            for j, part in enumerate(_parts(item)):
                if part.get("type") == "input_image":
                    where = f"body.input[{i}].content[{j}].image_url"
                    if part.get("image_url") is None and part.get("file_id") is not None:
                        raise ImageError(f"body.input[{i}].content[{j}].file_id", "file ids are not supported; give image_url")
                    refs.append(ImageRef(where, _url_string(where, part.get("image_url"))))
    return refs


def has_images(url: str, body: Mapping[str, Any]) -> bool:
    try:
        return bool(image_refs(url, body))
    except ImageError:
        return True


def count_images(url: str, body: Mapping[str, Any]) -> int:
    """How many image parts a line's body has (0 when one of them names no url: its line fails)."""
    try:
        return len(image_refs(url, body))
    except ImageError:
        return 0


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _parts(message: Any) -> list[dict[str, Any]]:
    content = message.get("content") if isinstance(message, dict) else None
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


def _url_string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ImageError(where, "an image needs a url (a data: URL, s3:// or https://)")
    return value


def check_count(refs: list[ImageRef], settings: ImageSettings) -> None:
    if len(refs) > settings.max_images_per_request:
        where = refs[settings.max_images_per_request].where
        raise ImageError(where, f"{len(refs)} images in one request, more than MAX_IMAGES_PER_REQUEST={settings.max_images_per_request}")


# ------------------------------------------------------------------------------- fetching, decoding


def fetch_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    """The image's encoded bytes, at most MAX_IMAGE_BYTES of them; ImageError for anything else."""
    scheme = _scheme(ref)
    if scheme == "data":
        return _data_url_bytes(ref, settings)
    if scheme == "s3":
        return _s3_bytes(ref, settings)
    if scheme == "https":
        return _https_bytes(ref, settings)
    raise _unsupported(ref)


def check_line(url: str, body: Mapping[str, Any], settings: ImageSettings) -> None:
    """Validation's look at a line's images: ImageError for the first part that is bad without
    fetching or decoding anything (too many images, a scheme not taken, an https host not allowed,
    an s3 URI without a bucket, a data: URL that is not an image type, not base64, or too big). The
    run makes the same checks, with the same messages, and then fetches and decodes."""
    refs = image_refs(url, body)
    check_count(refs, settings)
    for ref in refs:
        check_ref(ref, settings)


def check_ref(ref: ImageRef, settings: ImageSettings) -> None:
    """One part's checks that need no fetch and no decode (check_line)."""
    scheme = _scheme(ref)
    if scheme == "data":
        size = _base64_size(_data_payload(ref, settings))
        if size is None:
            raise _not_base64(ref)
        if size > settings.max_image_bytes:
            raise _too_big(ref, settings, size)
    elif scheme == "s3":
        _s3_key(ref)
    elif scheme == "https":
        _allowed_host(ref, settings)
    else:
        raise _unsupported(ref)


def _scheme(ref: ImageRef) -> str:
    return ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""


def _unsupported(ref: ImageRef) -> ImageError:
    shown = ref.url if len(ref.url) <= 60 else ref.url[:57] + "..."
    return ImageError(ref.where, f"unsupported image url {shown!r} (a data: URL, s3:// or an allowed https:// host)")


def _too_big(ref: ImageRef, settings: ImageSettings, size: int | None = None) -> ImageError:
    got = f" ({size} bytes)" if size is not None else ""
    return ImageError(ref.where, f"image is larger than MAX_IMAGE_BYTES={settings.max_image_bytes}{got}")


def _not_base64(ref: ImageRef) -> ImageError:
    return ImageError(ref.where, "the data: URL is not valid base64")


# A data: URL's media type: an image type, or bytes whose type is not said (a table's image bytes
# of a format io/table_inputs.py does not recognise), which the decoder then reads by content.
UNTYPED_BYTES = "application/octet-stream"


def _data_payload(ref: ImageRef, settings: ImageSettings) -> str:
    """A data: URL's base64 payload, stripped, once its header is checked (base64, an image media
    type) and its encoded length is within MAX_IMAGE_BYTES."""
    header, sep, payload = ref.url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ImageError(ref.where, "a data: URL image must be base64 (data:image/png;base64,...)")
    media = header[len("data:"):].split(";", 1)[0].strip().lower()
    if not media.startswith("image/") and media != UNTYPED_BYTES:
        said = f"not {media[:40]!r}" if media else "not a URL without one"
        raise ImageError(ref.where, f"a data: URL image must have an image media type (data:image/png;base64,...), {said}")
    # Checked on the encoded length first: a 1 GB payload is refused without decoding it.
    if (len(payload) // 4) * 3 > settings.max_image_bytes + 3:
        raise _too_big(ref, settings)
    return payload.strip()


def _data_url_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    payload = _data_payload(ref, settings)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _not_base64(ref) from None
    if len(data) > settings.max_image_bytes:
        raise _too_big(ref, settings, len(data))
    return data


# Characters of base64 decoded at a time by _base64_size (a multiple of 4: whole quanta).
BASE64_CHECK_CHARS = 1 << 20


def _base64_size(payload: str, chunk: int = BASE64_CHECK_CHARS) -> int | None:
    """The decoded size of `payload`, or None where `base64.b64decode(payload, validate=True)` (the
    run's decode: binascii's strict mode) would refuse it, holding no more than one chunk's bytes.
    The data before the padding is whole quanta of plain alphabet, decoded a chunk at a time and
    dropped; from the last quantum before the first `=` on, the rest is decoded in one call, where
    strict mode judges the padding as it would in the whole string."""
    pad = payload.find("=")
    cut = len(payload) if pad < 0 else max(0, pad // 4 * 4 - 4)
    cut -= cut % 4
    size = 0
    try:
        for start in range(0, cut, chunk):
            size += len(base64.b64decode(payload[start:min(start + chunk, cut)], validate=True))
        size += len(base64.b64decode(payload[cut:], validate=True))
    except (binascii.Error, ValueError):
        return None
    return size


def _s3_key(ref: ImageRef) -> None:
    try:
        storage.split_s3(ref.url)
    except ValueError as exc:
        raise ImageError(ref.where, f"not an S3 object URI: {exc}") from None


def _s3_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    _s3_key(ref)
    try:
        with storage.open_read(ref.url) as handle:
            data = handle.read(settings.max_image_bytes + 1)
    except FileNotFoundError:
        raise ImageError(ref.where, f"no such S3 object: {ref.url}") from None
    except storage.StorageError as exc:
        raise ImageError(ref.where, f"could not read {ref.url}: {exc.code}") from None
    except ValueError as exc:
        raise ImageError(ref.where, f"not an S3 object URI: {exc}") from None
    if len(data) > settings.max_image_bytes:
        raise _too_big(ref, settings)
    return data


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # A redirect could lead off the allowed hosts; it is an error to the line instead.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _allowed_host(ref: ImageRef, settings: ImageSettings) -> str:
    """The https url's host, when IMAGE_URL_ALLOWED_HOSTS lists it; ImageError otherwise."""
    try:
        host = (urllib.parse.urlsplit(ref.url).hostname or "").lower()
    except ValueError:  # e.g. an unbalanced [ in the host
        host = ""
    if host not in settings.allowed_hosts:
        allowed = ", ".join(settings.allowed_hosts) or "none"
        raise ImageError(ref.where, f"https images from {host or 'this url'} are not allowed (IMAGE_URL_ALLOWED_HOSTS: {allowed})")
    return host


def _https_bytes(ref: ImageRef, settings: ImageSettings) -> bytes:
    host = _allowed_host(ref, settings)
    last = ""
    for attempt in range(HTTPS_ATTEMPTS):
        if attempt:
            time.sleep(min(0.25 * 2**attempt, 2.0))
        try:
            with _OPENER.open(urllib.request.Request(ref.url, headers={"Accept": "image/*"}), timeout=settings.timeout_seconds) as response:
                data = response.read(settings.max_image_bytes + 1)
            if len(data) > settings.max_image_bytes:
                raise _too_big(ref, settings)
            return data
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code not in _RETRY_STATUSES:
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            last = str(getattr(exc, "reason", exc)) or type(exc).__name__
    raise ImageError(ref.where, f"could not fetch the image from {host}: {last}")


def decode(ref: ImageRef, data: bytes, settings: ImageSettings) -> Any:
    """The decoded image (PIL, RGB); the pixel limit is checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # This module's limit decides; PIL's own (a process global) still errors above 179 Mpx.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > settings.max_image_pixels:
                raise ImageError(ref.where, f"image is {width}x{height} pixels, more than MAX_IMAGE_PIXELS={settings.max_image_pixels}")
            image.load()
            return image.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError) as exc:
        reason = "not an image format that can be read" if isinstance(exc, UnidentifiedImageError) else f"refused as a decompression bomb ({exc})"
        raise ImageError(ref.where, reason) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(ref.where, f"the image data is damaged ({exc})") from None


def load_image(ref: ImageRef, settings: ImageSettings) -> Any:
    return decode(ref, fetch_bytes(ref, settings), settings)


def chat_messages_with_images(messages: list[dict[str, Any]], loaded: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The chat messages with each `image_url` part replaced, in order, by vLLM's decoded-image part
    (`{"type": "image_pil", "image_pil": image}`), so the engine never fetches or decodes."""
    it = iter(loaded)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            content = [{"type": "image_pil", "image_pil": next(it)} if isinstance(p, dict) and p.get("type") == "image_url" else p
                       for p in content]
            message = {**message, "content": content}
        out.append(message)
    if next(it, None) is not None:
        raise ValueError("more images than image parts")
    return out


def inline_images(url: str, body: Mapping[str, Any], settings: ImageSettings) -> dict[str, Any]:
    """The body with each image part's URL replaced by a data: URL of its bytes, fetched and checked
    as for the in-process engine (size, pixels, a readable image; https hosts, s3), so that a server
    the line is sent to (a warm engine) never fetches anything itself. ImageError names the part."""
    refs = image_refs(url, body)
    if not refs:
        return dict(body)
    check_count(refs, settings)
    from PIL import Image

    inlined = []
    for ref in refs:
        data = fetch_bytes(ref, settings)
        decode(ref, data, settings)  # the same checks as in-process: size, pixels, a readable image
        if _scheme(ref) == "data":
            inlined.append(ref.url)
            continue
        media = f"image/{(Image.open(io.BytesIO(data)).format or 'png').lower()}"  # the header says
        inlined.append(f"data:{media};base64," + base64.b64encode(data).decode())
    out = copy.deepcopy(dict(body))
    it = iter(inlined)
    if url == CHAT_URL:
        for message in _list(out.get("messages")):
            for part in _parts(message):
                if part.get("type") == "image_url":
                    if isinstance(part.get("image_url"), dict):
                        part["image_url"]["url"] = next(it)
                    else:
                        part["image_url"] = {"url": next(it)}
    elif url == RESPONSES_URL:
        for item in _list(out.get("input")):
            for part in _parts(item):
                if part.get("type") == "input_image":
                    part["image_url"] = next(it)
    return out


# ------------------------------------------------------------------------------- many lines at once


@dataclass(frozen=True)
class LineImages:
    """One line's images, decoded in order, or the first error among them."""

    line: int
    images: tuple[Any, ...] = ()
    error: ImageError | None = None


class ImageResolver:
    """Fetches and decodes images on a bounded pool (IMAGE_FETCH_CONCURRENCY threads)."""

    def __init__(self, settings: ImageSettings) -> None:
        self.settings = settings
        self._pool = ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="images")
        self.images_loaded = 0

    def __enter__(self) -> "ImageResolver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, wait: bool = True) -> None:
        """Stop: fetches not started are dropped; with `wait`, the running ones are waited for."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def submit(self, line: int, url: str, body: Mapping[str, Any]) -> Future[LineImages]:
        """Start loading one line's images; the future never raises ImageError, it carries it."""
        try:
            refs = image_refs(url, body)
            check_count(refs, self.settings)
        except ImageError as exc:
            done: Future[LineImages] = Future()
            done.set_result(LineImages(line, error=exc))
            return done
        parts = [self._pool.submit(load_image, ref, self.settings) for ref in refs]
        result: Future[LineImages] = Future()
        if not parts:
            result.set_result(LineImages(line))
            return result
        pending = [len(parts)]

        def one_done(_: Future[Any]) -> None:
            pending[0] -= 1
            if pending[0] == 0:
                try:
                    result.set_result(self._gather(line, parts))
                except BaseException as exc:  # a bug, not a bad image: the consumer re-raises it
                    result.set_exception(exc)

        for part in parts:
            part.add_done_callback(one_done)
        return result

    def _gather(self, line: int, parts: list[Future[Any]]) -> LineImages:
        images = []
        for part in parts:
            exc = part.exception()
            if isinstance(exc, ImageError):
                return LineImages(line, error=exc)
            if exc is not None:
                raise exc
            images.append(part.result())
        self.images_loaded += len(images)
        return LineImages(line, images=tuple(images))

    def resolve_all(self, lines: Iterable[tuple[int, str, Mapping[str, Any]]], window: int | None = None) -> Iterator[LineImages]:
        """Each (line, url, body)'s images in input order, at most `window` lines (default 4 x
        IMAGE_FETCH_CONCURRENCY) in flight ahead of the consumer: memory stays bounded while the
        next lines load."""
        window = window or 4 * self.settings.concurrency
        queue: deque[Future[LineImages]] = deque()
        for line, url, body in lines:
            queue.append(self.submit(line, url, body))
            if len(queue) >= window:
                yield queue.popleft().result()
        while queue:
            yield queue.popleft().result()

"""Streaming validation of OpenAI Batch input files.

Every physical line of the input is either passed on as a `BatchRequest` or answered with an error
line that names the line number, the code and the field. The file is read line by line, so memory
does not grow with the file's size (only the custom_ids seen, 8-16 bytes each: IdSet).
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

from pydantic import ValidationError

from batch_pipeline import contract
from batch_pipeline.contract import fastpath
from batch_pipeline.io import images
from batch_pipeline.contract.lines import error_line

_BOM = b"\xef\xbb\xbf"
_decode_fast = fastpath.decoder.decode
_FAST_ERRORS = fastpath.ERRORS
_FAST_URLS = fastpath.URLS
_CUSTOM_ID_RE = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.){0,256})"')


@dataclass(frozen=True)
class ValidationSettings:
    """What a line is checked against: the served model names and the configurable limits."""

    served_model_name: str
    embedding_model_name: str | None = None
    score_model_name: str | None = None  # /v1/score and /v1/rerank; None: the embedding model
    adapter_names: tuple[str, ...] = ()  # LORA_MODULES: served on the generation model
    other_models: tuple[str, ...] = ()  # MODELS_FILE: more generation models
    max_custom_id_length: int = contract.MAX_CUSTOM_ID_LENGTH
    max_line_bytes: int = 10 * 2**20
    # The batch's endpoint (the Batch API's `endpoint`): lines with another url are url_mismatch
    # errors, as OpenAI reports them. None: every supported url.
    endpoint: str | None = None
    # Served generation models that take images (models.takes_images, LLMResource.validation_settings):
    # a line with an image part for any other model is refused naming the part and the model.
    image_models: tuple[str, ...] = ()
    # A table input's column of images (the run config's batch.image_column); blank: none.
    image_column: str = ""
    # The image limits a line's images are checked against (io/images.check_line: count, scheme,
    # host, data: URL); None: MAX_IMAGES_PER_REQUEST, IMAGE_URL_ALLOWED_HOSTS, ... from the
    # environment, read at the first line with an image, as the run reads them.
    image_settings: images.ImageSettings | None = None

    def models_for(self, url: str) -> tuple[str, ...]:
        if url == contract.EMBEDDINGS_URL:
            return (self.embedding_model_name,) if self.embedding_model_name else ()
        if url in contract.SCORING_URLS:
            name = self.score_model_name or self.embedding_model_name
            return (name,) if name else ()
        return (self.served_model_name, *self.adapter_names, *self.other_models)


@dataclass
class ValidationSummary:
    lines: int = 0  # non-blank lines
    valid: int = 0
    invalid: int = 0
    bytes_read: int = 0
    sha256: str = ""
    errors_by_code: Counter = field(default_factory=Counter)
    endpoints: Counter = field(default_factory=Counter)
    models: Counter = field(default_factory=Counter)
    unreadable: str | None = None  # why a table input could not be read (to the end)
    image_column: str = ""  # a table input's column of images, as the run took it (blank: none)

    @property
    def endpoint(self) -> str:
        """The batch's endpoint: the most common one among valid lines (OpenAI allows one per file)."""
        if self.endpoints:
            return self.endpoints.most_common(1)[0][0]
        return contract.CHAT_URL

    def file_error(self) -> contract.BatchFileError | None:
        """A file-level problem that makes the whole batch `failed`, or None."""
        if self.unreadable:
            return contract.BatchFileError(code="unreadable_file", message=self.unreadable)
        if self.lines == 0:
            return contract.BatchFileError(code="empty_file", message="the input file has no requests")
        if self.valid == 0:
            codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.errors_by_code.items()))
            return contract.BatchFileError(
                code="no_valid_lines", message=f"every one of the {self.lines} lines is invalid ({codes})"
            )
        return None


class ValidLine(NamedTuple):
    """A valid input line, carried to inference as its original bytes (no re-serialization).
    A NamedTuple: one is made per line, and a frozen dataclass costs ~1 µs more each."""

    line: int
    custom_id: str
    url: str
    model: str
    raw: bytes

    def record(self) -> bytes:
        """The line as stored in _work/requests.jsonl."""
        return b'{"line":%d,"request":%s}\n' % (self.line, self.raw)

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.raw)["body"]


def request_from_record(record: dict[str, Any], batch_id: str = "") -> contract.BatchRequest:
    request = record["request"]
    return contract.BatchRequest(line=record["line"], custom_id=request["custom_id"], url=request["url"], body=request["body"],
                                 batch_id=batch_id)


@dataclass(frozen=True)
class InvalidLine:
    line: int
    custom_id: str | None
    code: str
    message: str

    def to_error_line(self, batch_id: str) -> dict[str, Any]:
        return error_line(batch_id, self.line, self.custom_id, self.code, self.message)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clean_loc(loc: Iterable[Any]) -> list[Any]:
    # Drop the synthetic parts pydantic adds for union branches ("str", "list[...]", "function-after[...]").
    return [p for p in loc if isinstance(p, int) or not (any(ch in str(p) for ch in "[]-") or p in ("str", "none"))]


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """For a union (a string or a list...) the useful error is the deepest one that is not a type mismatch."""

    def score(e: dict[str, Any]) -> tuple[int, int]:
        return (0 if e["type"].endswith("_type") or e["type"] == "none_required" else 1, len(_clean_loc(e["loc"])))

    return max(errors, key=score)


def _describe_pydantic(err: ValidationError, prefix: str) -> str:
    first = _most_specific(err.errors(include_url=False))
    loc = _clean_loc(first["loc"])
    where = _loc([prefix, *loc]) if prefix else _loc(loc)
    msg = first["msg"]
    field = re.match(r"(?:Value error, )?([a-z_0-9]+): (.*)", msg, re.S)
    if first["type"] == "value_error" and field and not loc:  # a check across fields that names one of them
        return f"{_loc([prefix, field.group(1)]) if prefix else field.group(1)}: {field.group(2)}"
    if first["type"] == "missing":
        return f"{where}: required field is missing"
    if first["type"] not in ("value_error", "model_type") and "input" in first:
        return f"{where}: {msg} (got {_short(first['input'])})"
    return f"{where}: {msg.removeprefix('Value error, ')}"


class IdSet:
    """custom_ids seen so far, as 64-bit hashes in an open-addressing table: 16 bytes per id at
    worst instead of ~80 for a Python set, so memory stays near-flat on million-line files. The
    hash is Python's own (salted per process, which is fine: the table lives for one file). A
    false duplicate needs a 64-bit collision: about 3 in a million for a 10M-line file."""

    def __init__(self, capacity: int = 1 << 16):
        self._table = array("Q", bytes(8 * capacity))
        self._mask = capacity - 1
        self._used = 0

    def add(self, custom_id: str) -> bool:
        """Record an id; False when it was seen before."""
        value = (hash(custom_id) & 0xFFFFFFFFFFFFFFFF) or 1  # 0 marks an empty slot
        table, mask = self._table, self._mask
        slot = value & mask
        while table[slot]:
            if table[slot] == value:
                return False
            slot = (slot + 1) & mask
        table[slot] = value
        self._used += 1
        if self._used * 2 > len(table):
            self._grow()
        return True

    def _grow(self) -> None:
        old = self._table
        table = self._table = array("Q", bytes(16 * len(old)))
        mask = self._mask = len(table) - 1
        for value in old:
            if value:
                slot = value & mask
                while table[slot]:
                    slot = (slot + 1) & mask
                table[slot] = value

    def __len__(self) -> int:
        return self._used


class _Refused(Exception):
    """A line refused by a check of LineValidator's slow path: its error code, what is wrong (field
    first), and its custom_id where one was read."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, custom_id


class LineValidator:
    """Validates lines one at a time, remembering custom_ids to answer repeats as duplicates."""

    def __init__(self, settings: ValidationSettings):
        self.settings = settings
        self._seen = IdSet()
        # No model for a url other than the batch's endpoint: the fast path leaves such lines to the
        # slow path, which names the mismatch.
        self._models = {url: settings.models_for(url) if settings.endpoint in (None, url) else ()
                        for url in contract.SUPPORTED_URLS}
        self._max_line_bytes = settings.max_line_bytes
        self._max_id = settings.max_custom_id_length
        self._image_settings = settings.image_settings

    def _remember(self, custom_id: str) -> bool:
        """Record a custom_id; False when it was seen before."""
        return self._seen.add(custom_id)

    def validate(self, line: int, raw: bytes) -> ValidLine | InvalidLine:
        # The hot path of validation: kept to plain local look-ups (measured per line at 100k lines).
        if len(raw) <= self._max_line_bytes:
            try:
                fast = _decode_fast(raw)
            except _FAST_ERRORS:
                fast = None
            if fast is not None:
                url = _FAST_URLS[type(fast)]
                custom_id = fast.custom_id
                model = fast.body.model
                if (
                    fast.method.upper() == "POST"
                    and len(custom_id) <= self._max_id
                    and model in self._models[url]
                    and self._seen.add(custom_id)
                ):
                    return ValidLine(line, custom_id, url, model, raw)
                # A repeat was just recorded by add(): the slow path reports it as a duplicate.
        return self._validate_slow(line, raw)

    def _validate_slow(self, line: int, raw: bytes) -> ValidLine | InvalidLine:
        """The authoritative checks, naming the line, the field and what is wrong: the JSON object,
        its custom_id, its method and url, then its body."""
        try:
            obj = self._object(raw)
            custom_id = self._custom_id(obj)
            url = self._url(obj, custom_id)
            model = self._body_model(url, obj.get("body"), custom_id)
        except _Refused as e:
            return InvalidLine(line=line, custom_id=e.custom_id, code=e.code, message=f"line {line}: {e.message}")
        return ValidLine(line, custom_id, url, model, raw)

    def _object(self, raw: bytes) -> dict[str, Any]:
        if len(raw) > self.settings.max_line_bytes:
            raise _Refused(contract.INVALID_REQUEST, f"the line is {len(raw)} bytes, over the limit of "
                           f"{self.settings.max_line_bytes} (MAX_LINE_BYTES)", _salvage_custom_id(raw[:4096]))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Refused(contract.INVALID_JSON, f"not valid UTF-8 (byte {e.start})", _salvage_custom_id(raw)) from None
        try:
            obj = json.loads(text, parse_constant=_reject_constant)
        except RecursionError:
            raise _Refused(contract.INVALID_JSON, "not valid JSON: nested too deeply", _salvage_custom_id(raw)) from None
        except ValueError as e:
            detail = f"{e.msg} (column {e.colno})" if isinstance(e, json.JSONDecodeError) else str(e)
            raise _Refused(contract.INVALID_JSON, f"not valid JSON: {detail}", _salvage_custom_id(raw)) from None
        if not isinstance(obj, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")
            raise _Refused(contract.INVALID_REQUEST, f"expected a JSON object, got {kind}")
        return obj

    def _custom_id(self, obj: dict[str, Any]) -> str:
        """The line's custom_id, recorded (a repeat is refused as a duplicate)."""
        custom_id = obj.get("custom_id")
        if custom_id is None:
            raise _Refused(contract.INVALID_REQUEST, "custom_id: required field is missing")
        if not isinstance(custom_id, str) or not custom_id:
            raise _Refused(contract.INVALID_REQUEST, f"custom_id: must be a non-empty string (got {_short(custom_id)})")
        if len(custom_id) > self.settings.max_custom_id_length:
            raise _Refused(contract.INVALID_REQUEST, f"custom_id: {len(custom_id)} characters, over the limit of "
                           f"{self.settings.max_custom_id_length}", custom_id)
        if not self._remember(custom_id):
            raise _Refused(contract.DUPLICATE_CUSTOM_ID, f"custom_id {custom_id!r} was already used by an earlier line",
                           custom_id)
        return custom_id

    def _url(self, obj: dict[str, Any], custom_id: str) -> str:
        """The line's endpoint, once its method is POST: one we serve, and the batch's."""
        method = obj.get("method")
        if not isinstance(method, str) or method.upper() != "POST":
            raise _Refused(contract.INVALID_METHOD, f"method: must be POST (got {_short(method)})", custom_id)
        url = obj.get("url")
        if url not in contract.SUPPORTED_URLS:
            raise _Refused(contract.UNSUPPORTED_URL, f"url: {_short(url)} is not supported; supported endpoints are "
                           f"{', '.join(contract.SUPPORTED_URLS)}", custom_id)
        if self.settings.endpoint is not None and url != self.settings.endpoint:
            raise _Refused(contract.URL_MISMATCH, f"url: {url} is not this batch's endpoint {self.settings.endpoint} "
                           "(every line of a batch uses its endpoint)", custom_id)
        return str(url)

    def _body_model(self, url: str, body: Any, custom_id: str) -> str:
        """The model the body names, once the body is valid for `url`, the model served, its images acceptable."""
        if not isinstance(body, dict):
            if body is None:
                raise _Refused(contract.INVALID_REQUEST, "body: required field is missing", custom_id)
            raise _Refused(contract.INVALID_REQUEST, f"body: must be a JSON object (got {_short(body)})", custom_id)
        refusal = self._image_refusal(url, body)
        if refusal:
            raise _Refused(contract.INVALID_REQUEST, refusal, custom_id)
        try:
            model = contract.BODY_MODELS[url].model_validate(body).model  # type: ignore[attr-defined]
        except ValidationError as e:
            raise _Refused(contract.INVALID_REQUEST, _describe_pydantic(e, "body"), custom_id) from None
        served = self.settings.models_for(url)
        if model not in served:
            serving = ", ".join(repr(name) for name in served) if served else "no model"
            raise _Refused(contract.MODEL_NOT_FOUND, f"body.model: {model!r} is not served here; {url} serves {serving}",
                           custom_id)
        problem = self._bad_image(url, body) if model in self.settings.image_models else None
        if problem:
            raise _Refused(contract.INVALID_REQUEST, problem, custom_id)
        return model

    def _bad_image(self, url: str, body: dict[str, Any]) -> str | None:
        """The first of a line's images that the run would refuse without fetching or decoding it
        (io/images.check_line), as `part: reason`, the message the run gives; None otherwise."""
        if url not in (contract.CHAT_URL, contract.RESPONSES_URL):
            return None
        if self._image_settings is None:
            self._image_settings = images.image_settings_from_env()
        try:
            images.check_line(url, body, self._image_settings)
        except images.ImageError as e:
            return str(e)
        return None


    def _image_refusal(self, url: str, body: dict[str, Any]) -> str | None:
        """An image part sent to a served model that does not take images, naming the part and the
        model; None otherwise (an unserved model is model_not_found below, as for text)."""
        model = body.get("model")
        if not isinstance(model, str) or model not in self.settings.models_for(url) or model in self.settings.image_models:
            return None
        try:
            refs = images.image_refs(url, body)
        except images.ImageError as e:
            return f"{e.where}: {model!r} does not take images (a text-only model)"
        if not refs:
            return None
        return f"{refs[0].where}: {model!r} does not take images (a text-only model)"


def _salvage_custom_id(raw: bytes) -> str | None:
    """Best effort: find the custom_id in a line that does not parse, so the error can name it."""
    match = _CUSTOM_ID_RE.search(raw)
    if not match:
        return None
    try:
        return json.loads(b'"' + match.group(1) + b'"')
    except ValueError:
        return None


def validate_stream(
    stream: BinaryIO,
    settings: ValidationSettings,
    on_valid: Callable[[ValidLine], None],
    on_invalid: Callable[[InvalidLine], None],
) -> ValidationSummary:
    """Validate every line of `stream`, handing each result to a callback; returns the counts."""
    summary = ValidationSummary()
    hasher = hashlib.sha256()
    validate = LineValidator(settings).validate
    lines = valid = size = 0
    kinds: dict[tuple[str, str], int] = {}  # (url, model) -> valid lines
    errors = summary.errors_by_code
    for number, raw in enumerate(stream, start=1):
        hasher.update(raw)
        size += len(raw)
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        raw = raw.rstrip(b"\r\n")
        if not raw or raw.isspace():
            continue
        lines += 1
        result = validate(number, raw)
        if type(result) is ValidLine:
            valid += 1
            key = (result.url, result.model)
            kinds[key] = kinds.get(key, 0) + 1
            on_valid(result)
        else:
            errors[result.code] += 1
            on_invalid(result)
    _finish(summary, lines, valid, kinds)
    summary.sha256 = hasher.hexdigest()
    summary.bytes_read = size
    return summary


def _finish(summary: ValidationSummary, lines: int, valid: int, kinds: dict[tuple[str, str], int]) -> None:
    summary.lines, summary.valid, summary.invalid = lines, valid, lines - valid
    for (url, model), n in kinds.items():
        summary.endpoints[url] += n
        summary.models[model] += n


def validate_rows(
    rows: Iterable[tuple[int, bytes | InvalidLine]],
    settings: ValidationSettings,
    on_valid: Callable[[ValidLine], None],
    on_invalid: Callable[[InvalidLine], None],
) -> ValidationSummary:
    """validate_stream for rows already turned into request lines (a table input: io/table_inputs.py),
    some refused before (an InvalidLine); the caller sets sha256 and bytes_read."""
    summary = ValidationSummary()
    validate = LineValidator(settings).validate
    lines = valid = 0
    kinds: dict[tuple[str, str], int] = {}
    for number, raw in rows:
        lines += 1
        result = raw if isinstance(raw, InvalidLine) else validate(number, raw)
        if type(result) is ValidLine:
            valid += 1
            kinds[(result.url, result.model)] = kinds.get((result.url, result.model), 0) + 1
            on_valid(result)
        else:
            summary.errors_by_code[result.code] += 1
            on_invalid(result)
    _finish(summary, lines, valid, kinds)
    return summary

"""Tables in: a Parquet or CSV batch file, each row one chat request, other columns carried through.

Columns read (any other column is carried through to results.parquet, in input order):
  prompt      the user message (string), with an optional `system` column (string): or
  messages    a list of {role, content} structs (a JSON string in a CSV)
  custom_id   optional; default: the row number (1-based, as a string)
  model       optional; default: SERVED_MODEL_NAME
  max_tokens, temperature   optional, per row (blank = the model's default)
  an image column           optional, named in the run config (`batch.image_column`), or else the
                            column TABLE_IMAGE_COLUMN names when the table has it: per row an
                            image (or a list of them) for the user message: bytes, a URI (data:,
                            s3://, https://) or a path relative to the table's own folder

Rows are read in record batches (Parquet by row group, CSV by blocks), so memory stays flat however
many rows the file holds. Each row becomes the JSON line of an OpenAI chat request and is validated as
such (row number = line number); a row that cannot become one (no prompt, a value of the wrong type)
is an `invalid_request` error row naming the row and the column.

An image column's bytes, and images at a path next to a local table, go into the request as data
URLs (so requests.jsonl holds them, and MAX_LINE_BYTES bounds a row); a path next to a table on
S3 becomes that object's s3:// URI, and URIs stay as they are: io/images.py fetches those ahead
of the engine. A path is read only inside the table's folder: an absolute path or one with `..`
is the row's error, so a table cannot make the pipeline read a file elsewhere on its machine.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from batch_pipeline.base.env import read_text
from batch_pipeline import contract
from batch_pipeline.io import images, storage

TABLE_SUFFIXES = (".parquet", ".csv")
READ_ROWS = 8_192  # rows per record batch read
REQUEST_COLUMNS = ("prompt", "system", "messages", "custom_id", "model", "max_tokens", "temperature")
PASSTHROUGH_NAME = "passthrough.parquet"  # _work/: the carried-through columns, with `line`


@dataclass(frozen=True)
class ImageColumn:
    """The column holding each row's image(s), and the folder (local or an s3:// prefix) of the
    table, where a relative path in it is read from."""

    name: str
    base: str
    max_bytes: int = images.DEFAULT_MAX_IMAGE_BYTES

    @classmethod
    def of(cls, name: str, table_uri: str) -> "ImageColumn | None":
        """The image column of the table at `table_uri`; None without a name."""
        if not name:
            return None
        return cls(name, table_uri.rsplit("/", 1)[0] if "/" in table_uri else ".",
                   images.image_settings_from_env().max_image_bytes)


def default_image_column(path: Path, env: dict[str, str] | None = None) -> str:
    """The image column of a run whose config names none (the upload sensor's, the nightly
    schedule's, a backfill's, `batch-pipeline run` without --image-column): TABLE_IMAGE_COLUMN when
    this table has a column of that name, else "" (a table without it is a text table, not an error)."""
    name = read_text(env, "TABLE_IMAGE_COLUMN")
    return name if name and name in file_schema(path).names else ""


def is_table(uri: str) -> bool:
    return uri.lower().endswith(TABLE_SUFFIXES)


class RowError(ValueError):
    """A row that cannot become a request: the message names the row and the column."""

    custom_id: str | None = None


class TableError(ValueError):
    """A table the run config does not fit (an image column it does not have): the batch fails."""


@contextmanager
def local_copy(uri: str) -> Iterator[tuple[Path, str]]:
    """(a local path of the file, its sha256): the file itself when local, else a spooled download.
    Table readers seek (Parquet reads its footer first), which an S3 stream cannot."""
    local = storage.local_path(uri)
    hasher = hashlib.sha256()
    if local is not None:
        with open(local, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                hasher.update(chunk)
        yield local, hasher.hexdigest()
        return
    with tempfile.NamedTemporaryFile(prefix="table-", suffix=Path(uri).suffix) as tmp:
        with storage.open_read(uri) as src:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                hasher.update(chunk)
                tmp.write(chunk)
        tmp.flush()
        yield Path(tmp.name), hasher.hexdigest()


def record_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The file's rows, a record batch at a time."""
    if path.suffix.lower() == ".parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=READ_ROWS)
        return
    # Every CSV column read as text: a type guessed from the first block would fail a later one
    # (a column of numbers with one word in row 900,000); request columns are parsed per row.
    yield from pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 22),
                              convert_options=_csv_as_text(path))


def _csv_as_text(path: Path) -> pacsv.ConvertOptions:
    names = pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 16)).schema.names
    return pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True)


def _text(row: dict[str, Any], column: str, number: int) -> str | None:
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if not isinstance(value, str):
        raise RowError(f"row {number}: column `{column}` must be text, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def _number(row: dict[str, Any], column: str, number: int, kind: type) -> int | float | None:
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        value = value.strip()
        if not value:
            return None
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if not isinstance(value, str) else int(value, 10)
        return float(value)
    except (TypeError, ValueError):
        raise RowError(f"row {number}: column `{column}` must be {'an integer' if kind is int else 'a number'}, "
                       f"got {str(value)[:40]!r}") from None


def _messages(row: dict[str, Any], number: int) -> list[dict[str, Any]]:
    if "messages" in row and row["messages"] is not None:
        value = row["messages"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise RowError(f"row {number}: column `messages` is not a JSON list of {{role, content}}") from None
        if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
            raise RowError(f"row {number}: column `messages` must be a non-empty list of {{role, content}}")
        return [{k: v for k, v in m.items() if v is not None} for m in value]
    prompt = _text(row, "prompt", number)
    if not prompt:
        raise RowError(f"row {number}: column `prompt` is empty" if "prompt" in row else
                       f"row {number}: no `prompt` or `messages` column in the file")
    system = _text(row, "system", number)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


def _data_url(data: bytes) -> str:
    mime = next((m for magic, m in _MAGIC if data.startswith(magic)), None)
    if mime is None:
        mime = "image/webp" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else "application/octet-stream"
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _image_url(value: Any, column: ImageColumn, number: int) -> str:
    """One image of a row as the url of an image part."""
    where = f"row {number}: column `{column.name}`"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _data_url(bytes(value))
    if not isinstance(value, str):
        raise RowError(f"{where} must hold image bytes, a URI or a path, got {type(value).__name__}")
    value = value.strip()
    if value.split(":", 1)[0].lower() in ("data", "s3", "https", "http") and ":" in value:
        return value  # fetched (or refused, naming the part) as any line's image url
    relative = PurePosixPath(value)
    if relative.is_absolute() or ".." in relative.parts or ":" in value or "\\" in value:
        raise RowError(f"{where}: {value[:80]!r} is not a path inside the table's folder; give a path relative "
                       "to it, or a URI (s3://, https://, data:)")
    if column.base.startswith("s3://"):
        return f"{column.base}/{relative}"
    path = Path(column.base) / relative
    try:
        with open(path, "rb") as handle:
            data = handle.read(column.max_bytes + 1)
    except OSError as e:
        raise RowError(f"{where}: cannot read {value[:80]!r} next to the table ({e.strerror or e})") from None
    if len(data) > column.max_bytes:
        raise RowError(f"{where}: {value[:80]!r} is larger than MAX_IMAGE_BYTES={column.max_bytes}")
    return _data_url(data)


def _row_images(row: dict[str, Any], column: ImageColumn, number: int) -> list[str]:
    value = row.get(column.name)
    if value is None or (isinstance(value, float) and math.isnan(value)) or (isinstance(value, str) and not value.strip()):
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_image_url(v, column, number) for v in values if v is not None]


def _with_images(messages: list[dict[str, Any]], urls: list[str], column: str, number: int) -> list[dict[str, Any]]:
    """The messages with the images appended to the last user message's content parts."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise RowError(f"row {number}: column `{column}` has an image but the row has no user message to put it in")
    last = messages[users[-1]]
    content = last.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [*messages[:users[-1]], {**last, "content": parts}, *messages[users[-1] + 1:]]


def request_line(row: dict[str, Any], number: int, default_model: str, image: ImageColumn | None = None) -> bytes:
    """The JSON line of the chat request a row stands for (RowError when it cannot be one); with
    `image`, the row's image(s) in its user message."""
    custom_id = row.get("custom_id")
    custom_id = str(number) if custom_id is None or custom_id == "" else str(custom_id)
    try:
        body: dict[str, Any] = {"model": _text(row, "model", number) or default_model,
                                "messages": _messages(row, number)}
        urls = _row_images(row, image, number) if image is not None else []
        if urls:
            body["messages"] = _with_images(body["messages"], urls, image.name, number)  # type: ignore[union-attr]
        max_tokens = _number(row, "max_tokens", number, int)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        temperature = _number(row, "temperature", number, float)
        if temperature is not None:
            body["temperature"] = temperature
    except RowError as e:
        e.custom_id = custom_id
        raise
    line = {"custom_id": custom_id, "method": "POST", "url": contract.CHAT_URL, "body": body}
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode()


def passthrough_schema(schema: pa.Schema, image_column: str = "") -> pa.Schema:
    """The columns a table input carries through (`line` first); not the image column, which can
    hold megabytes a row."""
    return pa.schema([pa.field("line", pa.int64(), nullable=False)]
                     + [f for f in schema if f.name not in REQUEST_COLUMNS and f.name != image_column])


def table_rows(path: Path, default_model: str, passthrough: Any,
               image: ImageColumn | None = None) -> Iterator[tuple[int, bytes | RowError]]:
    """(row number, request line or RowError) for every row; the carried-through columns of each
    record batch go to `passthrough` (a pyarrow ParquetWriter opened on passthrough_schema), or
    nowhere when it is None. With `image`, each row's image(s) from that column."""
    if image is not None and image.name not in file_schema(path).names:
        raise TableError(f"the image column `{image.name}` (batch.image_column) is not a column of this table")
    number = 0
    for batch in record_batches(path):
        rows = batch.to_pylist()
        if passthrough is not None:
            lines = pa.array(range(number + 1, number + 1 + len(rows)), pa.int64())
            keep = [name for name in batch.schema.names if name not in REQUEST_COLUMNS and name != (image.name if image else "")]
            table = pa.Table.from_arrays([lines, *(batch.column(n) for n in keep)], names=["line", *keep])
            passthrough.write_table(table.cast(passthrough.schema))
        for row in rows:
            number += 1
            try:
                yield number, request_line(row, number, default_model, image)
            except RowError as e:
                yield number, e


def file_schema(path: Path) -> pa.Schema:
    if path.suffix.lower() == ".parquet":
        return pq.read_schema(path)
    return pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 16),
                          convert_options=_csv_as_text(path)).schema

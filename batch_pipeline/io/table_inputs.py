"""Tables in: a Parquet or CSV batch file, each row one chat request, other columns carried through.

Columns read (any other column is carried through to results.parquet, in input order):
  prompt      the user message (string), with an optional `system` column (string): or
  messages    a list of {role, content} structs (a JSON string in a CSV)
  custom_id   optional; default: the row number (1-based, as a string)
  model       optional; default: SERVED_MODEL_NAME
  max_tokens, temperature   optional, per row (blank = the model's default)

Rows are read in record batches (Parquet by row group, CSV by blocks), so memory stays flat however
many rows the file holds. Each row becomes the JSON line of an OpenAI chat request and is validated as
such (row number = line number); a row that cannot become one (no prompt, a value of the wrong type)
is an `invalid_request` error row naming the row and the column.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from batch_pipeline.contract import contract
from batch_pipeline.io import storage

TABLE_SUFFIXES = (".parquet", ".csv")
READ_ROWS = 8_192  # rows per record batch read
REQUEST_COLUMNS = ("prompt", "system", "messages", "custom_id", "model", "max_tokens", "temperature")
PASSTHROUGH_NAME = "passthrough.parquet"  # _work/: the carried-through columns, with `line`


def is_table(uri: str) -> bool:
    return uri.lower().endswith(TABLE_SUFFIXES)


class RowError(ValueError):
    """A row that cannot become a request: the message names the row and the column."""

    custom_id: str | None = None


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


def request_line(row: dict[str, Any], number: int, default_model: str) -> bytes:
    """The JSON line of the chat request a row stands for (RowError when it cannot be one)."""
    custom_id = row.get("custom_id")
    custom_id = str(number) if custom_id is None or custom_id == "" else str(custom_id)
    try:
        body: dict[str, Any] = {"model": _text(row, "model", number) or default_model,
                                "messages": _messages(row, number)}
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


def passthrough_schema(schema: pa.Schema) -> pa.Schema:
    """The columns a table input carries through (`line` first)."""
    return pa.schema([pa.field("line", pa.int64(), nullable=False)]
                     + [f for f in schema if f.name not in REQUEST_COLUMNS])


def table_rows(path: Path, default_model: str, passthrough: Any) -> Iterator[tuple[int, bytes | RowError]]:
    """(row number, request line or RowError) for every row; the carried-through columns of each
    record batch go to `passthrough` (a pyarrow ParquetWriter opened on passthrough_schema), or
    nowhere when it is None."""
    number = 0
    for batch in record_batches(path):
        rows = batch.to_pylist()
        if passthrough is not None:
            lines = pa.array(range(number + 1, number + 1 + len(rows)), pa.int64())
            keep = [name for name in batch.schema.names if name not in REQUEST_COLUMNS]
            table = pa.Table.from_arrays([lines, *(batch.column(n) for n in keep)], names=["line", *keep])
            passthrough.write_table(table.cast(passthrough.schema))
        for row in rows:
            number += 1
            try:
                yield number, request_line(row, number, default_model)
            except RowError as e:
                yield number, e


def file_schema(path: Path) -> pa.Schema:
    if path.suffix.lower() == ".parquet":
        return pq.read_schema(path)
    return pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=1 << 16),
                          convert_options=_csv_as_text(path)).schema

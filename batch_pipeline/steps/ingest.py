"""The validation step of a batch: stream the input once, split valid requests from error lines.

JSONL is validated line by line; a Parquet or CSV input row by row (io/table_inputs.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batch_pipeline import contract
from batch_pipeline.base import ids
from batch_pipeline.io import storage, table_inputs
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.base.progress import Log, quiet
from batch_pipeline.steps.validation import (
    InvalidLine,
    ValidationSettings,
    ValidationSummary,
    ValidLine,
    validate_rows,
    validate_stream,
)


def validate_batch(loc: BatchLocation, settings: ValidationSettings, log: Log = quiet) -> dict[str, Any]:
    """Valid requests to _work/requests.jsonl, bad lines to _work/invalid.jsonl, counts to
    _work/validation.json (returned)."""
    created_at = int(time.time())
    started = time.perf_counter()
    etag = storage.describe(loc.input_uri).etag  # before reading: a file replaced meanwhile is not mistaken for this one
    with storage.open_write(loc.work("requests.jsonl")) as valid_out, storage.open_write(loc.work("invalid.jsonl")) as invalid_out:

        def on_valid(valid: ValidLine) -> None:
            valid_out.write(valid.record())

        def on_invalid(bad: InvalidLine) -> None:
            invalid_out.write(storage.json_line(asdict(bad)))
            log(f"{loc.name}: {bad.code} at {'row' if table else 'line'} {bad.line}")

        table = table_inputs.is_table(loc.input_uri)
        if table:
            summary = validate_table(loc.input_uri, settings, on_valid, on_invalid, loc.work(table_inputs.PASSTHROUGH_NAME))
            if summary.image_column and not settings.image_column:
                log(f"{loc.name}: images from its column `{summary.image_column}` (TABLE_IMAGE_COLUMN)")
        else:
            with storage.open_read(loc.input_uri) as src:
                summary = validate_stream(src, settings, on_valid, on_invalid)
    file_error = summary.file_error()
    info = {
        "batch_id": ids.batch_id(f"{loc.input_uri}\0{summary.sha256}\0{loc.partition}"),
        "name": loc.name,
        "input_uri": loc.input_uri,
        "input_etag": etag,
        "output_uri": loc.output_uri,
        "partition": loc.partition,
        "sha256": summary.sha256,
        "bytes": summary.bytes_read,
        "lines": summary.lines,
        "valid": summary.valid,
        "invalid": summary.invalid,
        "errors_by_code": dict(summary.errors_by_code),
        "endpoint": summary.endpoint,
        "model": summary.models.most_common(1)[0][0] if summary.models else None,
        "file_error": file_error.model_dump() if file_error else None,
        **({"image_column": summary.image_column} if summary.image_column else {}),
        "created_at": created_at,
        "seconds": round(time.perf_counter() - started, 4),
    }
    storage.write_json(loc.work("validation.json"), info)
    return info


def validate_table(uri: str, settings: ValidationSettings, on_valid: Callable[[ValidLine], None],
                   on_invalid: Callable[[InvalidLine], None], passthrough_uri: str | None = None) -> ValidationSummary:
    """A Parquet/CSV input: each row a chat request (io/table_inputs.py); with `passthrough_uri`,
    the columns it carries through go there (for results.parquet). A file that is not a readable
    table is a file-level error of the batch (`unreadable_file`), not a crash of the step."""
    with table_inputs.local_copy(uri) as (path, sha256), ExitStack() as stack:
        summary, broken, column = ValidationSummary(), [], ""
        try:
            # The run config's column (a table without it fails), else TABLE_IMAGE_COLUMN where the table has it.
            column = settings.image_column or table_inputs.default_image_column(path)
            passthrough = None
            if passthrough_uri:
                schema = table_inputs.passthrough_schema(table_inputs.file_schema(path), column)
                passthrough = stack.enter_context(pq.ParquetWriter(
                    stack.enter_context(storage.open_write(passthrough_uri)), schema, compression="zstd"))
            image = table_inputs.ImageColumn.of(column, uri)
            rows = _until_unreadable(table_inputs.table_rows(path, settings.served_model_name, passthrough, image), broken)
            summary = validate_rows(rows, settings, on_valid, on_invalid)  # the rows read before a corrupt part count
            if broken:
                raise broken[0]
        except table_inputs.TableError as e:  # e.g. no such image column
            summary.unreadable = f"{storage.basename(uri)}: {e}"
        except _UNREADABLE as e:  # not Parquet/CSV, or corrupt
            kind = "Parquet" if path.suffix.lower() == ".parquet" else "CSV"
            summary.unreadable = f"{storage.basename(uri)} cannot be read as {kind}: {str(e)[:300]}"
        summary.sha256, summary.bytes_read = sha256, path.stat().st_size
        summary.image_column = column
    return summary


_UNREADABLE = (pa.ArrowException, OSError)  # pyarrow's errors (ArrowInvalid is also a ValueError)


def _until_unreadable(rows: Iterator[tuple[int, bytes | table_inputs.RowError]],
                      broken: list[Exception]) -> Iterator[tuple[int, bytes | InvalidLine]]:
    """The rows as request lines or error lines, stopping (and recording why in `broken`) where the
    file cannot be read further."""
    while True:
        try:
            number, row = next(rows)
        except StopIteration:
            return
        except (*_UNREADABLE, table_inputs.TableError) as e:
            broken.append(e)
            return
        yield number, row if isinstance(row, bytes) else InvalidLine(
            line=number, custom_id=row.custom_id, code=contract.INVALID_REQUEST, message=str(row))

"""The validation step of a batch: stream the input once, split valid requests from error lines."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from batch_pipeline.lib import ids, storage
from batch_pipeline.lib.locations import BatchLocation
from batch_pipeline.lib.progress import Log, quiet
from batch_pipeline.lib.validation import InvalidLine, ValidationSettings, ValidLine, validate_stream


def validate_batch(loc: BatchLocation, settings: ValidationSettings, log: Log = quiet) -> dict[str, Any]:
    """Valid requests to _work/requests.jsonl, bad lines to _work/invalid.jsonl, counts to
    _work/validation.json (returned)."""
    created_at = int(time.time())
    started = time.perf_counter()
    etag = storage.describe(loc.input_uri).etag  # before reading: a file replaced meanwhile is not mistaken for this one
    with storage.open_read(loc.input_uri) as src, storage.open_write(loc.work("requests.jsonl")) as valid_out, storage.open_write(
        loc.work("invalid.jsonl")
    ) as invalid_out:

        def on_valid(valid: ValidLine) -> None:
            valid_out.write(valid.record())

        def on_invalid(bad: InvalidLine) -> None:
            invalid_out.write(storage.json_line(asdict(bad)))
            log(f"{loc.name}: {bad.code} at line {bad.line}")

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
        "created_at": created_at,
        "seconds": round(time.perf_counter() - started, 4),
    }
    storage.write_json(loc.work("validation.json"), info)
    return info

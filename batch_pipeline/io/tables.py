"""Results as a table: `results.parquet` beside `output.jsonl`, one row per input line, in input order.

A data team joins answers back to its data rather than flattening JSONL: each batch's results also
go to a Parquet file with an explicit schema (below), written by row groups. Rows are kept in
memory until the file is written, a few hundred bytes each plus the answer text (a 50,000-line
batch, OpenAI's limit per file, is tens of MB).

Columns: `line` (1-based input line), `custom_id`, `status` (`completed`, `failed`, `cancelled`,
`expired`),
`content` (the assistant message, a Response's output text, or the completion text; null for
embeddings and errors), `finish_reason`, `prompt_tokens`, `completion_tokens` (0 for lines that
never ran; a Response's input and output tokens), `error_code`, `error_message` (null when
completed), `tool_calls` (the first choice's `message.tool_calls` as a JSON string; null when it
made none). With `n` > 1, content and finish_reason are the first choice's.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batch_pipeline import contract
from batch_pipeline.io import storage

RESULTS_NAME = "results.parquet"
ROW_GROUP_ROWS = 10_000

RESULTS_SCHEMA = pa.schema([
    pa.field("line", pa.int64(), nullable=False),
    pa.field("custom_id", pa.string()),
    pa.field("status", pa.string(), nullable=False),
    pa.field("content", pa.string()),
    pa.field("reasoning", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64(), nullable=False),
    pa.field("completion_tokens", pa.int64(), nullable=False),
    pa.field("error_code", pa.string()),
    pa.field("error_message", pa.string()),
    pa.field("tool_calls", pa.string()),
])


# Lines that never ran because the batch stopped: their own status, not "failed".
_NOT_RUN = {contract.BATCH_CANCELLED: "cancelled", contract.BATCH_EXPIRED: "expired"}


def result_row(line: int, record: dict[str, Any]) -> dict[str, Any]:
    """The table row of one output.jsonl / errors.jsonl line."""
    row: dict[str, Any] = {"line": line, "custom_id": record.get("custom_id"), "status": "completed", "content": None,
                           "reasoning": None, "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0,
                           "error_code": None, "error_message": None, "tool_calls": None}
    error = record.get("error")
    if error:  # refused before it ran: validation, the engine's checks, cancellation, expiry
        row["status"] = _NOT_RUN.get(error.get("code"), "failed")
        row["error_code"], row["error_message"] = error.get("code"), error.get("message")
        return row
    response = record.get("response") or {}
    body = response.get("body") or {}
    if response.get("status_code", 200) != 200:  # the engine refused it: OpenAI's error body
        err = body.get("error") or {}
        row["status"] = "failed"
        row["error_code"] = err.get("code") or err.get("type") or f"http_{response.get('status_code')}"
        row["error_message"] = err.get("message")
        return row
    usage = body.get("usage") or {}
    if body.get("object") == "response":  # /v1/responses: the output_text, and its own usage names
        row["prompt_tokens"] = int(usage.get("input_tokens") or 0)
        row["completion_tokens"] = int(usage.get("output_tokens") or 0)
        row["content"] = "".join(part.get("text", "") for item in body.get("output") or [] if item.get("type") == "message"
                                 for part in item.get("content") or [] if part.get("type") == "output_text")
        row["finish_reason"] = "length" if body.get("status") == "incomplete" else "stop"
        thinking = "".join(part.get("text", "") for item in body.get("output") or [] if item.get("type") == "reasoning"
                           for part in item.get("content") or [])
        row["reasoning"] = thinking or None
        return row
    row["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
    row["completion_tokens"] = int(usage.get("completion_tokens") or 0)
    choices = body.get("choices") or []
    if choices:
        first = choices[0]
        message = first.get("message")
        row["content"] = message.get("content") if isinstance(message, dict) else first.get("text")
        row["reasoning"] = message.get("reasoning_content") if isinstance(message, dict) else None
        row["finish_reason"] = first.get("finish_reason")
        if isinstance(message, dict) and message.get("tool_calls"):
            row["tool_calls"] = json.dumps(message["tool_calls"], ensure_ascii=False)
    return row


class ResultsTable:
    """The rows of one batch's results, gathered in any order and written in input order."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, line: int, record: dict[str, Any]) -> None:
        self.rows.append(result_row(line, record))

    def write(self, uri: str, passthrough_uri: str | None = None) -> int:
        """Write results.parquet (atomically, by row groups); returns the number of rows. With
        `passthrough_uri` (a table input's carried-through columns, one row per input row, in
        order), those columns follow the results' own, renamed `input_<name>` where a name is taken."""
        self.rows.sort(key=lambda r: r["line"])
        extra = _open_parquet(passthrough_uri) if passthrough_uri else None
        schema, renamed = RESULTS_SCHEMA, []
        if extra is not None:
            taken = set(RESULTS_SCHEMA.names)
            fields = [f for f in extra.schema_arrow if f.name != "line"]
            renamed = [f"input_{f.name}" if f.name in taken else f.name for f in fields]
            schema = pa.schema(list(RESULTS_SCHEMA) + [f.with_name(n) for f, n in zip(fields, renamed)])
        carried = _Taker(extra.iter_batches(batch_size=ROW_GROUP_ROWS)) if extra is not None else None
        with storage.open_write(uri) as handle, pq.ParquetWriter(handle, schema, compression="zstd") as writer:
            if not self.rows:
                writer.write_table(schema.empty_table())
            for start in range(0, len(self.rows), ROW_GROUP_ROWS):
                group = pa.Table.from_pylist(self.rows[start:start + ROW_GROUP_ROWS], schema=RESULTS_SCHEMA)
                if carried is not None:
                    group = _with_columns(group, carried.take(group.num_rows), renamed)
                writer.write_table(group)
        return len(self.rows)


def _open_parquet(uri: str) -> pq.ParquetFile:
    local = storage.local_path(uri)
    # A Parquet reader seeks (footer first); S3 objects are read whole for that.
    return pq.ParquetFile(str(local) if local else io.BytesIO(storage.read_bytes(uri)))


class _Taker:
    """Exactly n rows at a time from record batches of any size."""

    def __init__(self, batches: Iterator[pa.RecordBatch]) -> None:
        self.batches, self.pending = batches, []

    def take(self, n: int) -> pa.Table:
        have = sum(b.num_rows for b in self.pending)
        while have < n:
            batch = next(self.batches, None)
            if batch is None:
                break
            self.pending.append(batch)
            have += batch.num_rows
        table = pa.Table.from_batches(self.pending) if self.pending else None
        if table is None:
            raise RuntimeError("the carried-through columns have fewer rows than the results: validate the batch again")
        head, rest = table.slice(0, n), table.slice(n)
        self.pending = rest.to_batches() if rest.num_rows else []
        return head


def _with_columns(group: pa.Table, carried: pa.Table, names: list[str]) -> pa.Table:
    """`group` (results rows) with the input's carried-through columns of the same rows."""
    if carried.num_rows != group.num_rows or carried.column(0).to_pylist() != group.column("line").to_pylist():
        raise RuntimeError("the carried-through columns do not line up with the results (rows "
                           f"{carried.column(0)[0]}.. vs lines {group.column('line')[0]}..): validate the batch again")
    for name, column in zip(names, carried.columns[1:]):
        group = group.append_column(name, column.combine_chunks())
    return group


def read_head(uri: str, rows: int = 5) -> tuple[pa.Schema, list[dict[str, Any]]]:
    """The schema and first rows of a results.parquet (the first row group only is read)."""
    parquet = _open_parquet(uri)
    if parquet.num_row_groups == 0:
        return parquet.schema_arrow, []
    return parquet.schema_arrow, parquet.read_row_group(0).slice(0, rows).to_pylist()


def write_metrics_table(uri: str, per_batch: list[dict[str, Any]]) -> None:
    """A date's metrics.parquet: one row per batch (its metrics.json), for pandas."""
    import pandas as pd  # here, not at import: loading the definitions (code server, sensors, run workers) needs none

    table = pa.Table.from_pandas(pd.DataFrame(per_batch), preserve_index=False)  # the union of their keys
    with storage.open_write(uri) as handle:
        pq.write_table(table, handle, compression="zstd")

"""The results step of a batch: output.jsonl, errors.jsonl, results.parquet and the Batch object (batch.json)."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Iterator
from typing import Any

from batch_pipeline import contract
from batch_pipeline.io import storage
from batch_pipeline.io.checkpoints import LineSet, answers_in_line_order
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.contract.lines import cancelled_line, expired_line
from batch_pipeline.io.table_inputs import PASSTHROUGH_NAME
from batch_pipeline.io.tables import RESULTS_NAME, ResultsTable
from batch_pipeline.steps.metrics import batch_cost, cost_metadata
from batch_pipeline.steps.validation import InvalidLine

EXPIRY_SECONDS = 24 * 3600  # OpenAI's completion window, recorded as expires_at


def _in_line_order(loc: BatchLocation, key: str | None, not_run: bool) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line, kind, item) of every line of the batch, in input order: "invalid" lines (validation's),
    "answer"s (checkpointed, each line's first) and, with `not_run` (cancelled or expired), the
    valid requests that no answer covers. Each source is in line order; they are merged."""
    invalid = ((bad["line"], "invalid", bad) for bad in storage.iter_jsonl(loc.work("invalid.jsonl")))
    answered, sorted_answers = answers_in_line_order(loc, key) if key else (LineSet(), iter(()))
    answers = ((a["line"], "answer", a) for a in sorted_answers)
    left: Iterator[tuple[int, str, dict[str, Any]]] = iter(())
    if not_run:
        left = ((req["line"], "not_run", req) for req in storage.iter_jsonl(loc.work("requests.jsonl"))
                if req["line"] not in answered)
    return heapq.merge(invalid, answers, left, key=lambda item: item[0])


@dataclasses.dataclass
class LineCounts:
    """What a batch's result lines add up to: answers, error lines and their tokens."""

    output: int = 0
    error: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def usage(self) -> contract.Usage:
        return contract.Usage(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
            input_tokens_details=contract.InputTokensDetails(cached_tokens=self.cached_tokens),
            output_tokens_details=contract.OutputTokensDetails(reasoning_tokens=self.reasoning_tokens),
        )


def finalize_batch(loc: BatchLocation, extra_metadata: dict[str, str] | None = None, cancelled: bool = False) -> dict[str, Any]:
    """Write output.jsonl, errors.jsonl and batch.json from the validation and checkpoint files.

    Every input line is written exactly once: an answer that a concurrent or repeated attempt also
    wrote is skipped. When `cancelled`, requests without an answer are reported as batch_cancelled
    (the next run of the batch computes them and rewrites these files); when the inference step
    stopped at the run's deadline (`expired_at` in its record), as batch_expired, and the batch is
    expired.
    """
    started = time.perf_counter()
    validation = storage.read_json(loc.work("validation.json"))
    has_inference = validation["valid"] and storage.exists(loc.work("inference.json"))
    inference = storage.read_json(loc.work("inference.json")) if has_inference else None
    attempt = inference or {}  # the answering step's record; empty when nothing was to answer
    expired_at = attempt.get("expired_at") if not attempt.get("finished_at") else None
    counts, table = _write_lines(loc, validation, inference, cancelled, bool(expired_at))
    # The same lines as a table, in input order (a table input's other columns carried through).
    passthrough = loc.work(PASSTHROUGH_NAME)
    table.write(loc.out(RESULTS_NAME), passthrough if storage.exists(passthrough) else None)
    status = ("failed" if validation["file_error"] else "cancelled" if cancelled else "expired" if expired_at
              else "completed")
    batch = _batch_object(loc, validation, attempt, counts, status, expired_at, extra_metadata)
    storage.write_json(loc.out("batch.json"), batch.model_dump(mode="json"))
    storage.write_json(loc.work("finalize.json"), {"seconds": round(time.perf_counter() - started, 4)})
    return batch.model_dump(mode="json")


def _write_lines(loc: BatchLocation, validation: dict[str, Any], inference: dict[str, Any] | None, cancelled: bool,
                 expired: bool) -> tuple[LineCounts, ResultsTable]:
    """output.jsonl and errors.jsonl, each input line once in input order, and the same lines as a
    table (not written yet); refused, publishing nothing, unless every line has its answer or error."""
    batch_id = validation["batch_id"]
    counts, seen, table = LineCounts(), LineSet(), ResultsTable()
    with storage.open_write(loc.out("output.jsonl")) as out, storage.open_write(loc.out("errors.jsonl")) as err:
        # Every line in input order, whatever order the engine answered them in (ORDER=planned).
        for line, kind, item in _in_line_order(loc, inference["checkpoint_key"] if inference else None,
                                               cancelled or expired):
            if not seen.add(line):
                continue
            if kind == "answer":
                record = item["record"]
                (out if item["kind"] == "output" else err).write(storage.json_line(record))
                counts.output += item["kind"] == "output"
                counts.error += item["kind"] != "output"
                counts.input_tokens += item.get("prompt_tokens", 0)
                counts.output_tokens += item.get("completion_tokens", 0)
                counts.cached_tokens += item.get("cached_tokens", 0)
                counts.reasoning_tokens += item.get("reasoning_tokens", 0)
            else:  # an invalid line, or a request the cancelled or expired run did not answer
                record = (InvalidLine(**item).to_error_line(batch_id) if kind == "invalid" else
                          (cancelled_line if cancelled else expired_line)(batch_id, line, item["request"]["custom_id"]))
                err.write(storage.json_line(record))
                counts.error += 1
            table.add(line, record)
        if counts.output + counts.error != validation["lines"]:
            # Raised inside the writers: nothing is published, the old files (if any) stay.
            raise RuntimeError(
                f"{loc.name}: {validation['lines']} lines in, but {counts.output} answers + "
                f"{counts.error} errors: inference has not finished (run inference_results first)"
            )
    return counts, table


def _batch_object(loc: BatchLocation, validation: dict[str, Any], attempt: dict[str, Any], counts: LineCounts,
                  status: str, expired_at: int | None, extra_metadata: dict[str, str] | None) -> contract.Batch:
    """The Batch object of a finalized batch (`attempt`: the answering step's record, {} if none)."""
    finished = int(time.time())
    file_error = validation["file_error"]
    return contract.Batch(
        id=validation["batch_id"],
        endpoint=validation["endpoint"],
        model=validation["model"],
        input_file_id=loc.input_uri,
        status=status,
        output_file_id=loc.out("output.jsonl"),
        error_file_id=loc.out("errors.jsonl"),
        errors=contract.BatchErrors(data=[contract.BatchFileError(**file_error)]) if file_error else None,
        created_at=validation["created_at"],
        in_progress_at=attempt.get("in_progress_at"),
        finalizing_at=attempt.get("finished_at") or finished,
        completed_at=finished if status == "completed" else None,
        failed_at=finished if status == "failed" else None,
        cancelling_at=finished if status == "cancelled" else None,
        cancelled_at=finished if status == "cancelled" else None,
        expired_at=expired_at if status == "expired" else None,
        expires_at=attempt.get("expires_at") or validation["created_at"] + EXPIRY_SECONDS,
        request_counts=contract.RequestCounts(total=validation["lines"], completed=counts.output, failed=counts.error),
        usage=counts.usage(),
        metadata={
            "partition": loc.partition,
            "input_sha256": validation["sha256"],
            "input_etag": validation.get("input_etag", ""),
            **({"checkpoint_key": attempt["checkpoint_key"]} if attempt else {}),
            **({k: str(v) for k, v in attempt["engine"].items()} if attempt else {}),
            # What it cost (GPU- and engine-seconds, model load, tokens): strings, as the SDK keeps metadata.
            **cost_metadata(batch_cost(attempt, {"input_tokens": counts.input_tokens,
                                                 "output_tokens": counts.output_tokens})),
            **(extra_metadata or {}),
        },
    )

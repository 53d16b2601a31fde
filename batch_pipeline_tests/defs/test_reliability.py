"""Crashes, cancellation and repeated runs: every input line is answered exactly once.

- the real `batch-pipeline run` killed with SIGKILL (whole process group) mid-inference, then run
  again (its run_batch, in the test process on the session's engine): it resumes from the
  checkpoints and the result files hold each custom_id once;
- a run interrupted as Dagster interrupts a terminated step (failure injection: an engine whose
  step() raises after a few calls): batch.json says cancelled, answers so far are kept, the rest
  are batch_cancelled, and the next run completes the batch;
- hostile inputs through the whole pipeline;
- privacy: logs and Dagster events carry ids, counts and timings, never prompt or completion text.
Runs the tiny model; real answers are test_e2e_smollm2.py's job.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import threading
import sys
import time
import types
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.defs.jobs import run_batch
from batch_pipeline.defs import assets
from batch_pipeline.defs.assets import RETRY_DELAY_SECONDS
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline_tests.support.asset_runs import materialize
from batch_pipeline_tests.support.cli_runs import answered_once, killed_after_parts, read_results
from batch_pipeline_tests.support import TINY_NAME, SessionLLM, tiny_env, wait_for


def chat_line(custom_id: str, max_tokens: int = 4, content: str = "", **body) -> str:
    payload = {"model": TINY_NAME, "messages": [{"role": "user", "content": content or f"question {custom_id}"}],
               "max_tokens": max_tokens, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": payload})


def test_sigkill_mid_inference_then_rerun_answers_every_line_once(tiny_model_dir, tiny_llm, tmp_path):
    ids = [f"k-{i:03d}" for i in range(300)]
    batch = tmp_path / "big.jsonl"
    # Output lengths differ (24-72 tokens, 48 on average), so ORDER=planned feeds the lines out of
    # file order (longest first) both in the killed run and in the rerun.
    batch.write_text("\n".join(chat_line(i, max_tokens=24 + (n * 7) % 49, ignore_eos=True) for n, i in enumerate(ids)) + "\n")
    out = tmp_path / "out"
    env = tiny_env(tiny_model_dir, CHECKPOINT_ANSWERS="20", BATCH_SIZE="32", ORDER="planned")
    command = [str(Path(sys.executable).parent / "batch-pipeline"), "run", str(batch), "--output-dir", str(out)]

    saved = killed_after_parts(command, env, out)
    assert 0 < saved < len(ids)
    assert not (out / "batch.json").exists()  # nothing final was published by the killed run

    # The rerun: what `batch-pipeline run` runs (run_batch), in this process on the session's engine
    # (a second CLI process only adds a vLLM import and an engine build, ~30 s here).
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()  # the CLI's default --date
    with dg.instance_for_test() as instance:
        second = run_batch(str(batch), str(out), today, resources={"llm": tiny_llm, "storage": storage}, instance=instance)
        assert second.success
        messages = [str(r.user_message) for r in instance.all_logs(second.run_id)]
    assert any(f"{saved} of {len(ids)} requests already answered; resuming" in m for m in messages), messages
    assert any(f"planned the order of {len(ids) - saved} requests" in m for m in messages), messages
    outputs, errors, batch_obj = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and batch_obj["status"] == "completed"
    assert batch_obj["request_counts"] == {"total": 300, "completed": 300, "failed": 0}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_requests"] == saved


class _FaultyEngine:
    """Failure injection: the real engine, but after `after_steps` steps step() raises `fault()`
    (when it returns an exception)."""

    def __init__(self, llm: Any, after_steps: int):
        self._llm, self._left = llm, after_steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def fault(self) -> BaseException | None:
        raise NotImplementedError

    @property
    def llm_engine(self) -> Any:
        outer = self

        class _Engine:
            def __getattr__(self, name: str) -> Any:
                return getattr(outer._llm.llm_engine, name)

            def step(self) -> Any:
                outer._left -= 1
                if outer._left < 0:
                    exc = outer.fault()
                    if exc is not None:
                        raise exc
                return outer._llm.llm_engine.step()

        return _Engine()


class _InterruptingEngine(_FaultyEngine):
    """step() raises as a terminated Dagster step does."""

    def fault(self) -> BaseException:
        return dg.DagsterExecutionInterruptedError("terminated from the UI")


class InterruptedLLM(SessionLLM):
    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return _InterruptingEngine(super().build_engine(kwargs), after_steps=10)


def test_terminated_run_says_cancelled_keeps_answers_and_next_run_resumes(tiny_llm, tmp_path):
    ids = [f"c-{i:02d}" for i in range(40)]
    batch = tmp_path / "cancel.jsonl"
    # Short requests finish within the first steps, long ones are still running when the "terminate"
    # comes. In file order: ORDER=planned would feed the long ones first, and with an engine of 8
    # sequences (this test's, when it builds the session's engine) none would finish by step 10.
    lines = [chat_line(i, max_tokens=2 if n % 2 else 40, ignore_eos=True) for n, i in enumerate(ids)]
    batch.write_text("\n".join(lines) + "\n" + '{"broken"\n')
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))

    interrupted = tiny_llm.rebuilt(InterruptedLLM, batch_size=8, checkpoint_answers=4, order="input")
    result = run_batch(str(batch), str(out), "2026-11-30", resources={"llm": interrupted, "storage": storage})
    assert not result.success
    outputs, errors, batch_obj = read_results(out)
    assert batch_obj["status"] == "cancelled" and batch_obj["cancelled_at"]
    answered_once(outputs, errors, ids + [None])
    cancelled = [e for e in errors if e["error"] and e["error"]["code"] == "batch_cancelled"]
    assert outputs and cancelled, (len(outputs), len(cancelled))
    assert batch_obj["request_counts"] == {"total": 41, "completed": len(outputs), "failed": len(cancelled) + 1}

    result = run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage})
    assert result.success
    outputs2, errors2, batch2 = read_results(out)
    answered_once(outputs2, errors2, ids + [None])
    assert batch2["status"] == "completed" and len(outputs2) == 40
    kept = {o["custom_id"]: o["response"]["body"]["choices"] for o in outputs}
    assert all(o["response"]["body"]["choices"] == kept[o["custom_id"]] for o in outputs2 if o["custom_id"] in kept)


class LaterInterruptedLLM(SessionLLM):
    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return _InterruptingEngine(super().build_engine(kwargs), after_steps=20)


def test_interrupt_while_answering_a_date_together_cancels_only_the_unfinished_file(tiny_llm, tmp_path):
    # ORDER=planned answers a date's files as one stream: all 6 lines run at once (the engine takes
    # 8 sequences or more), "early"'s 4-token lines are done by step 5, "late"'s 60-token ones are
    # still decoding when the "terminate" comes at step 20.
    day = tmp_path / "in" / "2026-11-30"
    day.mkdir(parents=True)
    late = [f"late-{i:02d}" for i in range(4)]
    (day / "early.jsonl").write_text("\n".join(chat_line(f"early-{i}", max_tokens=4, ignore_eos=True) for i in range(2)) + "\n")
    (day / "late.jsonl").write_text("\n".join(chat_line(i, max_tokens=60, ignore_eos=True) for i in late) + "\n")
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(out))
    interrupted = tiny_llm.rebuilt(LaterInterruptedLLM, batch_size=8, checkpoint_answers=4, order="planned")
    result = materialize(interrupted, str(tmp_path / "in"), str(out), partition="2026-11-30")
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    reason = failure.step_failure_data.user_failure_data.description
    assert reason == "cancelled: late; the next run resumes the rest", reason
    early = json.loads((out / "2026-11-30" / "early" / "_work" / "inference.json").read_text())
    assert early["finished_at"] and early["computed_requests"] == 2 and early["answered_with"] == ["late"]
    assert json.loads((out / "2026-11-30" / "late" / "batch.json").read_text())["status"] == "cancelled"
    assert not (out / "2026-11-30" / "early" / "batch.json").exists()  # its results come with the next run

    result = materialize(tiny_llm, str(tmp_path / "in"), str(out), partition="2026-11-30")
    assert result.success
    for name, ids in (("early", ["early-0", "early-1"]), ("late", late)):
        outputs, errors, batch_obj = read_results(out / "2026-11-30" / name)
        answered_once(outputs, errors, ids)
        assert batch_obj["status"] == "completed" and not errors, name
    assert json.loads((out / "2026-11-30" / "early" / "_work" / "inference.json").read_text())["finished_at"] == early["finished_at"]


HOSTILE = {
    "invalid utf-8": (b'{"custom_id": "u", "x": "\xc3\x28"}\n', "invalid_json"),
    "NaN": (b'{"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": {"temperature": NaN}}\n', "invalid_json"),
    "deep nesting": (b'{"custom_id": "d", "body": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n", "invalid_json"),
    "long custom_id": ((chat_line("x" * 65) + "\n").encode(), "invalid_request"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_line_is_an_error_line_and_its_neighbours_run(case, tiny_llm, tmp_path):
    data, code = HOSTILE[case]
    batch = tmp_path / "hostile.jsonl"
    batch.write_bytes((chat_line("before") + "\n").encode() + data + (chat_line("after") + "\n").encode())
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    assert run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage}).success
    outputs, errors, batch_obj = read_results(out)
    assert sorted(o["custom_id"] for o in outputs) == ["after", "before"]
    assert [(e["error"]["code"], e["error"]["line"]) for e in errors] == [(code, 2)]
    assert batch_obj["status"] == "completed" and batch_obj["request_counts"]["total"] == 3


@pytest.mark.parametrize(
    "data,code", [(b"", "empty_file"), (b"[1]\n{oops\n", "no_valid_lines")], ids=["empty file", "only bad lines"]
)
def test_file_level_failures_fail_the_batch_with_an_errors_list(data, code, tiny_llm, tmp_path):
    batch = tmp_path / "f.jsonl"
    batch.write_bytes(data)
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    assert not run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage}).success
    batch_obj = json.loads((out / "batch.json").read_text())
    assert batch_obj["status"] == "failed" and batch_obj["errors"]["data"][0]["code"] == code


def test_repeated_runs_write_identical_results(tiny_llm, tmp_path):
    batch = tmp_path / "same.jsonl"
    batch.write_text("\n".join(chat_line(f"r-{i}") for i in range(6)))
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    for _ in range(2):
        assert run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage}).success
        outputs, errors, _ = read_results(out)
        answered_once(outputs, errors, [f"r-{i}" for i in range(6)])
    assert len(list((out / "_work" / "answers").iterdir())) == 1


def test_logs_and_dagster_events_carry_no_prompt_or_completion_text(tiny_llm, tmp_path, capfd):
    secret = "zebra-quartz-secret-7391"
    lines = [chat_line(f"p-{i}", content=f"{secret} tell me about item {i}", max_tokens=12) for i in range(4)]
    lines.append(chat_line("p-bad", content=secret, temperature=7))  # an invalid line carrying the secret
    batch = tmp_path / "private.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    with dg.instance_for_test() as instance:
        result = run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage},
                           instance=instance, log_level="DEBUG")
        assert result.success
        records = instance.all_logs(result.run_id)
        event_text = "\n".join(str(r.user_message) + repr(r.dagster_event) for r in records)
    captured = capfd.readouterr()
    completions = [
        choice["message"]["content"]
        for o in read_results(out)[0]
        for choice in o["response"]["body"]["choices"]
        if len(choice["message"]["content"].strip()) >= 12
    ]
    for text in [event_text, captured.out, captured.err]:
        assert secret not in text
        for completion in completions:
            assert completion not in text
    assert "5 lines, 4 valid, 1 invalid" in event_text  # what is logged: ids, counts, timings


def test_two_concurrent_runs_of_one_batch_neither_corrupt_nor_double_it(tiny_model_dir, tmp_path):
    """A sensor run and a backfill of the same batch at once: both succeed, each line once."""
    ids = [f"cc-{i:03d}" for i in range(60)]
    batch = tmp_path / "shared.jsonl"
    batch.write_text("\n".join(chat_line(i, max_tokens=16, ignore_eos=True) for i in ids) + "\n[1]\n")
    out = tmp_path / "out"
    env = tiny_env(tiny_model_dir, CHECKPOINT_ANSWERS="8")
    command = [str(Path(sys.executable).parent / "batch-pipeline"), "run", str(batch), "--output-dir", str(out)]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
    outputs, errors, batch_obj = read_results(out)
    answered_once(outputs, errors, ids + [None])
    assert batch_obj["status"] == "completed"
    assert batch_obj["request_counts"] == {"total": 61, "completed": 60, "failed": 1}
    assert len({o["id"] for o in outputs}) == 60


class _DyingEngine(_FaultyEngine):
    """The engine dies once mid-batch (as a crashed engine core does); the retry's engine lives."""

    died = False

    def fault(self) -> BaseException | None:
        if _DyingEngine.died:
            return None
        _DyingEngine.died = True
        return RuntimeError("EngineCore died unexpectedly")


class DyingLLM(SessionLLM):
    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        return _DyingEngine(super().build_engine(kwargs), after_steps=10)


def dying_engine_batch(tmp_path: Path, prefix: str) -> tuple[list[str], Path, Path, StorageResource]:
    """40 lines (short and long ones) for an engine that dies once mid-batch: ids, file, output folder."""
    ids = [f"{prefix}-{i:02d}" for i in range(40)]
    batch = tmp_path / f"{prefix}.jsonl"
    batch.write_text("\n".join(chat_line(i, max_tokens=2 if n % 2 else 40, ignore_eos=True) for n, i in enumerate(ids)))
    out = tmp_path / "out"
    _DyingEngine.died = False
    return ids, batch, out, StorageResource(input_path=str(tmp_path), output_path=str(out))


def test_engine_death_is_retried_by_dagster_and_resumes_from_checkpoints(tiny_llm, tmp_path):
    ids, batch, out, storage = dying_engine_batch(tmp_path, "d")
    result = run_batch(str(batch), str(out), "2026-11-30",
                       resources={"llm": tiny_llm.rebuilt(DyingLLM, checkpoint_answers=2), "storage": storage})
    assert _DyingEngine.died
    assert result.success  # inference_results' RetryPolicy re-ran the step
    retries = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert len(retries) == 1
    outputs, errors, batch_obj = read_results(out)
    answered_once(outputs, errors, ids)
    assert batch_obj["status"] == "completed"
    assert json.loads((out / "_work" / "inference.json").read_text())["resumed_requests"] > 0


def test_a_50_mb_line_is_rejected_and_its_neighbours_run(tiny_llm, tmp_path):
    huge = json.dumps({"custom_id": "huge", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": "x" * (50 * 2**20)}]}})
    batch = tmp_path / "huge.jsonl"
    batch.write_text("\n".join([chat_line("small-1"), huge, chat_line("small-2")]))
    out = tmp_path / "out"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(out))
    assert run_batch(str(batch), str(out), "2026-11-30", resources={"llm": tiny_llm, "storage": storage}).success
    outputs, errors, _ = read_results(out)
    assert sorted(o["custom_id"] for o in outputs) == ["small-1", "small-2"]
    [error] = errors
    assert error["custom_id"] == "huge" and error["error"]["code"] == "invalid_request"
    assert "over the limit of 10485760 (MAX_LINE_BYTES)" in error["error"]["message"]


def test_ctrl_c_while_a_retry_waits_cancels_instead_of_retrying(tiny_llm, tmp_path, monkeypatch):
    """Defect: Ctrl-C (or a terminate) during the 5 s wait before a retry was only seen as the retry
    began, outside the step's own code: the batch was neither cancelled nor reported cancelled. The
    wait is now inside the step: the interrupt cancels it there, with no further attempt."""
    ids, batch, out, storage = dying_engine_batch(tmp_path, "w")
    retry_waiting = threading.Event()

    def noted_sleep(seconds: float) -> None:
        if seconds == RETRY_DELAY_SECONDS:
            retry_waiting.set()
        time.sleep(seconds)  # the step's own wait, passed through

    # The assets module's clock, with the retry's wait made visible (assets.py calls only time.sleep).
    monkeypatch.setattr(assets, "time", types.SimpleNamespace(**{**vars(time), "sleep": noted_sleep}))

    def ctrl_c_during_the_wait() -> None:
        wait_for("the retry waiting RETRY_DELAY_SECONDS", retry_waiting.is_set, 300, interval=0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Dagster holds SIGINT while it runs the job

    assert RETRY_DELAY_SECONDS >= 5
    threading.Thread(target=ctrl_c_during_the_wait, daemon=True).start()
    result = run_batch(str(batch), str(out), "2026-11-30",
                       resources={"llm": tiny_llm.rebuilt(DyingLLM, checkpoint_answers=2), "storage": storage})
    assert _DyingEngine.died and not result.success
    assert len([e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]) == 1  # no second retry
    failure = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][-1]
    assert "cancelled" in failure.step_failure_data.user_failure_data.description
    outputs, errors, batch_obj = read_results(out)
    assert batch_obj["status"] == "cancelled"
    answered_once(outputs, errors, ids)
    cancelled = [e for e in errors if e["error"]["code"] == "batch_cancelled"]
    assert outputs and cancelled and len(outputs) + len(cancelled) == 40
    # Nothing was answered after the crash: the retry was cancelled while it waited.
    assert json.loads((out / "_work" / "inference.json").read_text())["finished_at"] is None

"""Tests for nightly_batch_schedule (batch_pipeline/defs/schedules.py), evaluated in-process.

Covers: the date a tick runs (the UTC day before the tick, across month ends, leap days and
ticks given in other time zones), one batch_file_job run per file of that date (dated folder plus
undated files uploaded that day, nothing from other days), their run keys and partitions, files
already completed (no run), a date without files (skipped, saying so), a tick before the first
partition (skipped), the schedule as the Definitions declare it; the runs it requests,
materialized on the tiny model; and a date run (batch_job, the CLI's) over a date without files,
which must finish in seconds without building an engine (the LLM resource raises if it is asked
for one).

Does not touch the daemon or the UI (test_dagster_e2e.py fires the schedule through the daemon).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.defs import assets
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.io import storage as store
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
from batch_pipeline.engine import vllm_adapter
from batch_pipeline.defs.schedules import NIGHTLY_CRON, nightly_requests, nightly_schedule_for, previous_day

nightly_batch_schedule = nightly_schedule_for(NIGHTLY_CRON)
from batch_pipeline_tests.support.cli_runs import jsonl_records
from batch_pipeline_tests.support import TINY_NAME

UTC = dt.timezone.utc


def tick(when: dt.datetime, inbox: Path, out: Path | None = None) -> list[dg.RunRequest] | dg.SkipReason:
    """What the schedule's tick at `when` asks for (the daemon's tick also adds the runs' batch_files
    partitions to the instance first: test_dagster_e2e.py fires it through the daemon)."""
    storage = StorageResource(input_path=str(inbox), output_path=str(out or inbox.parent / "out"))
    return nightly_requests(previous_day(when), storage)


def one_file(inbox: Path, day: str, name: str = "one") -> Path:
    path = inbox / day / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(chat_line(name) + "\n")
    return path


@pytest.mark.parametrize(
    ("when", "partition"),
    [
        (dt.datetime(2026, 11, 30, 2, 0, tzinfo=UTC), "2026-11-29"),
        (dt.datetime(2025, 3, 1, 2, 0, tzinfo=UTC), "2025-02-28"),
        (dt.datetime(2024, 3, 1, 2, 0, tzinfo=UTC), "2024-02-29"),
        (dt.datetime(2026, 1, 1, 2, 0, tzinfo=UTC), "2025-12-31"),
        # 01:30 in New York on 30 Nov is 06:30 UTC on 30 Nov: still the 29th's run.
        (dt.datetime(2026, 11, 30, 1, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5))), "2026-11-29"),
        # 02:00 in Berlin on 1 Dec is 01:00 UTC on 1 Dec: the 30th.
        (dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))), "2026-11-30"),
    ],
)
def test_tick_runs_yesterdays_files(when: dt.datetime, partition: str, tmp_path: Path) -> None:
    path = one_file(tmp_path / "in", partition)
    [request] = tick(when, tmp_path / "in")
    assert request.job_name is None  # the schedule's job, batch_file_job
    assert request.partition_key == f"{partition}/one"
    assert request.run_key == f"nightly-{partition}/one@{store.describe(str(path)).etag}"
    assert request.tags["batch_pipeline/input_uri"] == str(path) and request.tags["batch_pipeline/date"] == partition
    assert not request.run_config  # the file is the partition key


def test_one_run_per_file_not_yet_completed(tmp_path: Path) -> None:
    inbox, out = tmp_path / "in", tmp_path / "out"
    day, when = "2026-11-29", dt.datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
    files = [one_file(inbox, day, n) for n in ("a", "b", "c")]
    done = out / day / "b" / "batch.json"
    done.parent.mkdir(parents=True)
    done.write_text(json.dumps({"status": "completed", "metadata": {"input_etag": store.describe(str(files[1])).etag}}))
    assert [r.partition_key for r in tick(when, inbox, out)] == [f"{day}/a", f"{day}/c"]
    for path in (files[0], files[2]):
        done = out / day / path.stem / "batch.json"
        done.parent.mkdir(parents=True)
        done.write_text(json.dumps({"status": "completed", "metadata": {"input_etag": store.describe(str(path)).etag}}))
    skipped = tick(when, inbox, out)
    assert isinstance(skipped, dg.SkipReason)
    assert skipped.skip_message == f"{day}: 3 batch file(s) under {inbox}, all already completed; no run"
    empty = tick(dt.datetime(2026, 11, 29, 2, 0, tzinfo=UTC), inbox, out)
    assert empty.skip_message == f"2026-11-28: 0 batch file(s) under {inbox}, none; no run"


def test_tick_before_the_first_partition_is_skipped(tmp_path: Path) -> None:
    skipped = tick(dt.datetime(2024, 1, 1, 2, 0, tzinfo=UTC), tmp_path)
    assert isinstance(skipped, dg.SkipReason)
    assert "2023-12-31 is outside the partitions" in skipped.skip_message


def test_schedule_as_defined() -> None:
    from batch_pipeline.definitions import defs

    schedule = defs().resolve_schedule_def("nightly_batch_schedule")
    assert schedule.cron_schedule == NIGHTLY_CRON == "0 2 * * *"
    assert schedule.execution_timezone == "UTC"
    assert schedule.job_name == "batch_file_job"
    assert schedule.required_resource_keys == {"storage"}
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED


def materialize(request: dg.RunRequest, llm: LLMResource, inbox: Path, out: Path) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        BATCH_ASSETS,
        partition_key=request.partition_key,
        run_config=request.run_config or None,
        resources={"batch": BatchSelection(), "llm": llm, "storage": StorageResource(input_path=str(inbox), output_path=str(out))},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def metadata_of(result: dg.ExecuteInProcessResult, asset: str) -> dict[str, Any]:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return {k: v.value for k, v in event.materialization.metadata.items()}


class NoEngineLLM(LLMResource):
    """Failure injection: any attempt to build an engine fails the run."""

    def build_engine(self, kwargs: dict[str, Any]) -> Any:
        raise AssertionError(f"an engine was built for {kwargs.get('model')}")


def test_a_date_without_files_finishes_fast_without_an_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inbox, out = tmp_path / "in", tmp_path / "out"
    inbox.mkdir()
    (inbox / "2026-11-28").mkdir()  # another day's folder, and a file uploaded another day
    (inbox / "2026-11-28" / "other.jsonl").write_text("{}\n")
    (inbox / "loose.jsonl").write_text("{}\n")
    stamp = dt.datetime(2026, 11, 28, 12, tzinfo=UTC).timestamp()
    os.utime(inbox / "loose.jsonl", (stamp, stamp))
    assert isinstance(tick(dt.datetime(2026, 11, 30, 2, 0, tzinfo=UTC), inbox, out), dg.SkipReason)
    request = dg.RunRequest(partition_key="2026-11-29")  # a date run of batch_job, as the CLI starts
    # vLLM's import ahead of the GPU step is recorded, not done (10-20 s of CPU this test has no use for).
    imports: list[str] = []
    monkeypatch.setattr(vllm_adapter, "import_vllm", lambda: imports.append("vllm"))

    started = time.perf_counter()
    result = materialize(request, NoEngineLLM(model_path="/nonexistent/model", served_model_name=TINY_NAME), inbox, out)
    elapsed = time.perf_counter() - started

    assert result.success
    assert elapsed < 30, f"an empty date took {elapsed:.1f}s"  # ~2 s here; generous for a loaded machine
    for asset in ("validated_requests", "inference_results", "batch_outputs"):
        assert metadata_of(result, asset)["batches"] == 0
    assert "model_load_seconds" not in metadata_of(result, "inference_results")  # no zeros in the plots
    assert metadata_of(result, "throughput_metrics") == {"batches": 0}
    assert imports == []  # nothing to answer: vLLM is not even imported
    # Nothing but the run's record of the (no) batches it took.
    assert [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()] == [f"2026-11-29/.runs/{result.run_id}.json"]

    # The injection is live: the same resource fails the run once the date has a request to answer
    # (after the GPU step's retries, here without their wait).
    monkeypatch.setattr(assets, "RETRY_DELAY_SECONDS", 0.0)
    (inbox / "2026-11-29").mkdir()
    (inbox / "2026-11-29" / "one.jsonl").write_text(chat_line("x") + "\n")
    failed = materialize(request, NoEngineLLM(model_path="/nonexistent/model", served_model_name=TINY_NAME), inbox, out)
    assert not failed.success
    assert "an engine was built" in str(failed.get_step_failure_events()[0].step_failure_data.error)
    assert imports == ["vllm"]


def chat_line(custom_id: str) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_the_nightly_run_takes_every_file_of_the_date(tiny_llm, tmp_path: Path) -> None:
    inbox, out = tmp_path / "in", tmp_path / "out"
    day = "2025-03-14"
    files = {
        inbox / day / "dated.jsonl": ["d-1", "d-2"],
        inbox / "uploaded-that-day.jsonl": ["u-1"],
        inbox / "uploaded-next-day.jsonl": ["n-1"],
        inbox / "2025-03-13" / "day-before.jsonl": ["b-1"],
    }
    for path, ids in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(chat_line(i) for i in ids) + "\n")
    for name, when in [("uploaded-that-day.jsonl", (2025, 3, 14, 23, 59)), ("uploaded-next-day.jsonl", (2025, 3, 15, 0, 1))]:
        stamp = dt.datetime(*when, tzinfo=UTC).timestamp()
        os.utime(inbox / name, (stamp, stamp))

    requests = tick(dt.datetime(2025, 3, 15, 2, 0, tzinfo=UTC), inbox, out)
    assert [r.partition_key for r in requests] == [f"{day}/dated", f"{day}/uploaded-that-day"]
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("batch_files", [r.partition_key for r in requests])
    for request in requests:
        result = dg.materialize([batch_files], partition_key=request.partition_key, run_config=request.run_config or None,
                                resources={"batch": BatchSelection(), "llm": tiny_llm,
                                           "storage": StorageResource(input_path=str(inbox), output_path=str(out))},
                                instance=instance)
        assert result.success

    assert sorted(p.name for p in (out / day).iterdir()) == ["dated", "uploaded-that-day"]
    for name, ids in [("dated", ["d-1", "d-2"]), ("uploaded-that-day", ["u-1"])]:
        batch = json.loads((out / day / name / "batch.json").read_text())
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": len(ids), "completed": len(ids), "failed": 0}
        answered = [r["custom_id"] for r in jsonl_records((out / day / name / "output.jsonl").read_text())]
        assert sorted(answered) == ids
    assert not (out / "2025-03-13").exists()


def test_nightly_cron_is_configurable_when_definitions_load(monkeypatch):
    from batch_pipeline.definitions import defs
    from batch_pipeline.config.settings import ConfigError

    monkeypatch.setenv("NIGHTLY_CRON", "30 4 * * *")
    assert defs().resolve_schedule_def("nightly_batch_schedule").cron_schedule == "30 4 * * *"
    with pytest.raises(ConfigError, match="NIGHTLY_CRON='every night' is not a valid cron"):
        nightly_schedule_for("every night")


def test_nightly_runs_take_a_configurable_priority_on_the_batch_apis_scale(monkeypatch, tmp_path: Path) -> None:
    from batch_pipeline.config.priority import PRIORITY_TAG, TURN_SPAN
    when = dt.datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
    one_file(tmp_path / "in", "2026-11-29")

    def tick(when: dt.datetime) -> dg.RunRequest:
        [request] = globals()["tick"](when, tmp_path / "in")
        return request

    default = tick(when)
    assert PRIORITY_TAG not in default.tags  # Dagster's queue reads no tag as priority 0
    monkeypatch.setenv("SCHEDULE_RUN_PRIORITY", "-3")  # below API batches of priority 0
    low = tick(when)
    assert int(low.tags[PRIORITY_TAG]) == -3 * TURN_SPAN
    # An API batch of priority 0 waiting its 5th turn still starts before it; one of -4 after it.
    assert -3 * TURN_SPAN < 0 * TURN_SPAN - 5 and -4 * TURN_SPAN - 0 < int(low.tags[PRIORITY_TAG])
    monkeypatch.setenv("SCHEDULE_RUN_PRIORITY", "1001")
    from batch_pipeline.config.settings import ConfigError

    with pytest.raises(ConfigError, match=r"SCHEDULE_RUN_PRIORITY='1001' is out of range \(-1000 to 1000"):
        tick(when)

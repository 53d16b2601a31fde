"""The Dagster assets end to end in-process (`dg.materialize`) on the tiny model with real vLLM.

Covers: the four assets and the failed_line_rate check on a partition's batch files, the result
files against the contract (exactly one answer per line), metadata, a file-level failure, re-runs
reusing checkpointed answers (no engine load), S3 input and output over a real S3 server, and the whole
Definitions object. Does not start a Dagster daemon or web server (test_dagster_e2e.py does).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import BatchSelection, StorageResource
from batch_pipeline.io import storage
from batch_pipeline.steps.inference import infer_batch
from batch_pipeline.steps.ingest import validate_batch
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.steps.results import finalize_batch
from batch_pipeline_tests.support.asset_runs import DATE, chat_line, materialize, metadata_of, read_jsonl, write_batch
from batch_pipeline_tests.support import REPO, TINY_NAME, SessionLLM


@pytest.fixture
def partition_with_two_batches(tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "alpha.jsonl", [chat_line(f"a-{i}") for i in range(5)] + ["{not json", chat_line("a-0")])
    write_batch(inbox / DATE, "beta.jsonl", [chat_line("b-1"), chat_line("b-2", temperature=9)])
    write_batch(inbox / "2026-11-28", "other-day.jsonl", [chat_line("x")])
    return inbox, out


def test_partition_run_answers_every_line_once(tiny_llm, partition_with_two_batches):
    inbox, out = partition_with_two_batches
    result = materialize(tiny_llm, str(inbox), str(out))
    assert result.success

    alpha = out / DATE / "alpha"
    outputs, errors = read_jsonl(str(alpha / "output.jsonl")), read_jsonl(str(alpha / "errors.jsonl"))
    assert sorted(o["custom_id"] for o in outputs) == [f"a-{i}" for i in range(5)]
    assert [(e["error"]["code"], e["error"]["line"]) for e in errors] == [("invalid_json", 6), ("duplicate_custom_id", 7)]
    batch = json.loads((alpha / "batch.json").read_text())
    assert batch["status"] == "completed" and batch["object"] == "batch"
    assert batch["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    assert batch["usage"]["output_tokens"] == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs)
    assert batch["metadata"]["partition"] == DATE and batch["metadata"]["served_model_name"] == TINY_NAME
    assert batch["output_file_id"].endswith("alpha/output.jsonl")
    metrics = json.loads((alpha / "metrics.json").read_text())
    assert metrics["requests_completed"] == 5 and metrics["inference_seconds"] > 0
    assert metrics["output_tokens_per_second"] > 0 and metrics["peak_memory_mb"] > 0
    assert metrics["input_tokens_per_second"] > 0
    assert metrics["input_tokens"] == batch["usage"]["input_tokens"] > 0
    for key in ("model_load_seconds", "validation_seconds", "inference_seconds", "writing_seconds"):
        assert isinstance(metrics[key], float), key

    beta = json.loads((out / DATE / "beta" / "batch.json").read_text())
    assert beta["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert not (out / "2026-11-28").exists()  # another date's file is not this partition's work

    validated = metadata_of(result, "validated_requests")
    assert (validated["batches"], validated["lines"], validated["valid"], validated["invalid"]) == (2, 9, 6, 3)
    throughput = metadata_of(result, "throughput_metrics")
    assert throughput["requests_completed"] == 6 and throughput["requests_failed"] == 3
    assert throughput["requests_per_second"] > 0 and throughput["engine"].startswith("vllm")
    assert throughput["input_tokens_per_second"] > 0 and "gpu_utilization_mean_pct" not in throughput  # no GPU here

    [check] = result.get_asset_check_evaluations()
    assert check.check_name == "failed_line_rate" and check.passed is False  # 3 of 9 > 10%
    # Declared unpartitioned (the UI then shows one latest result everywhere): the date is in its text.
    assert check.partition is None
    assert check.metadata["failed"].value == 3
    # It names the batches above the limit and why their lines failed, worst first.
    assert check.description.startswith(f"{DATE}: 3 of 9 lines failed (33.3%) in 2 batch(es), above the 10% limit")
    assert "alpha: 2 of 7 (28.6%; duplicate_custom_id 1, invalid_json 1) -> " in check.description, check.description
    assert "beta: 1 of 2 (50.0%; invalid_request 1)" in check.description
    assert check.description.index("alpha:") < check.description.index("beta:")


def test_rerun_reuses_checkpointed_answers_without_loading_a_model(tiny_llm, partition_with_two_batches, monkeypatch):
    inbox, out = partition_with_two_batches
    assert materialize(tiny_llm, str(inbox), str(out)).success
    first = (out / DATE / "alpha" / "output.jsonl").read_bytes()

    def no_engine(_kwargs):
        raise AssertionError("a re-run of finished shards must not build an engine")

    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: no_engine(kwargs))
    again = batch_run_config(skip_completed=False)
    result = materialize(tiny_llm, str(inbox), str(out), run_config=again)
    assert result.success
    assert (out / DATE / "alpha" / "output.jsonl").read_bytes() == first
    inference = metadata_of(result, "inference_results")
    assert "inference_seconds" not in inference  # nothing computed: no figures
    assert "| alpha | 0 | 0 | 0.0 |" in inference["summary"]  # batch, resumed, computed, seconds


def test_a_date_run_again_skips_completed_batches_and_redoes_changed_files(
    tiny_llm, partition_with_two_batches, monkeypatch
):
    inbox, out = partition_with_two_batches
    assert materialize(tiny_llm, str(inbox), str(out)).success
    before = (out / DATE / "beta" / "batch.json").read_text()
    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: pytest.fail("engine built"))
    result = materialize(tiny_llm, str(inbox), str(out))
    validated = metadata_of(result, "validated_requests")  # nothing validated; the date's counts as they are
    assert result.success and (validated["batches_this_run"], validated["batches"]) == (0, 2)
    assert (out / DATE / "beta" / "batch.json").read_text() == before  # untouched

    monkeypatch.undo()
    write_batch(inbox / DATE, "beta.jsonl", [chat_line("b-1"), chat_line("b-2"), chat_line("b-3")])  # new content
    result = materialize(tiny_llm, str(inbox), str(out))
    validated = metadata_of(result, "validated_requests")
    assert result.success and validated["batches_this_run"] == 1 and validated["batches"] == 2  # the date's
    beta = json.loads((out / DATE / "beta" / "batch.json").read_text())
    assert beta["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_two_files_that_would_share_a_result_folder_are_refused(tiny_llm, tmp_path):
    inbox = tmp_path / "in"
    write_batch(inbox / DATE, "same.jsonl", [chat_line("a")])
    write_batch(inbox / DATE, "same.json", [chat_line("b")])
    result = materialize(tiny_llm, str(inbox), str(tmp_path / "out"))
    assert not result.success
    assert not (tmp_path / "out" / DATE / "same" / "batch.json").exists()


def test_changed_model_does_not_reuse_stale_checkpoints(tiny_llm, partition_with_two_batches):
    inbox, out = partition_with_two_batches
    assert materialize(tiny_llm, str(inbox), str(out)).success
    other = tiny_llm.rebuilt(seed=99)
    again = batch_run_config(skip_completed=False)
    assert materialize(other, str(inbox), str(out), run_config=again).success
    checkpoint_dirs = list((out / DATE / "alpha" / "_work" / "answers").iterdir())
    assert len(checkpoint_dirs) == 2  # a new checkpoint key, not the old checkpoint
    assert json.loads((out / DATE / "alpha" / "batch.json").read_text())["metadata"]["seed"] == "99"


def test_date_without_files_finishes_without_an_engine(tiny_llm, tmp_path, monkeypatch):
    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: pytest.fail("engine built"))
    result = materialize(tiny_llm, str(tmp_path / "empty-in"), str(tmp_path / "out"))
    assert result.success
    assert metadata_of(result, "throughput_metrics")["batches"] == 0


def test_file_of_only_bad_lines_fails_the_batch_and_the_run(tiny_llm, tmp_path):
    path = write_batch(tmp_path / "in", "bad.jsonl", ["[1]", "{oops", chat_line("x", temperature=-1)])
    out = tmp_path / "out"
    result = materialize(tiny_llm, "", "", run_config=batch_run_config(str(path), str(out)))
    assert not result.success
    batch = json.loads((out / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["failed_at"]
    assert batch["errors"]["data"][0]["code"] == "no_valid_lines"
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert len(read_jsonl(str(out / "errors.jsonl"))) == 3 and read_jsonl(str(out / "output.jsonl")) == []


def test_s3_input_and_output_over_a_real_s3_server(tiny_llm, s3_bucket, tmp_path):
    lines = [chat_line("s-1"), chat_line("s-2", content="北京"), '{"custom_id": "s-3"']
    storage.write_bytes(f"s3://{s3_bucket}/incoming/{DATE}/night.jsonl", ("\n".join(lines)).encode())
    result = materialize(tiny_llm, f"s3://{s3_bucket}/incoming", f"s3://{s3_bucket}/output")
    assert result.success
    base = f"s3://{s3_bucket}/output/{DATE}/night"
    assert sorted(o["custom_id"] for o in read_jsonl(f"{base}/output.jsonl")) == ["s-1", "s-2"]
    assert [e["custom_id"] for e in read_jsonl(f"{base}/errors.jsonl")] == ["s-3"]
    assert json.loads(storage.read_text(f"{base}/batch.json"))["request_counts"]["completed"] == 2
    assert storage.exists(f"{base}/metrics.json")


def test_runs_are_recorded_in_a_persistent_instance(tiny_llm, partition_with_two_batches, tmp_path):
    inbox, out = partition_with_two_batches
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())  # the project's own instance config
    with dg.instance_for_test(temp_dir=str(home)) as instance:
        assert materialize(tiny_llm, str(inbox), str(out), instance=instance).success
        event = instance.get_latest_materialization_event(dg.AssetKey("throughput_metrics"))
        assert event is not None and event.asset_materialization.partition == DATE
        assert event.asset_materialization.metadata["requests_completed"].value == 6


def test_definitions_load_with_expected_assets_jobs_and_resources():
    from batch_pipeline.definitions import defs

    definitions = defs() if callable(defs) else defs
    repo = definitions.get_repository_def()
    keys = sorted(k.to_user_string() for k in repo.asset_graph.get_all_asset_keys())
    assert keys == ["batch_files", "batch_outputs", "inference_results", "throughput_metrics", "validated_requests"]
    job = definitions.resolve_job_def("batch_job")
    assert job.partitions_def is not None
    files = definitions.resolve_job_def("batch_file_job")
    assert files.partitions_def is not None and files.partitions_def.name == "batch_files"
    assert definitions.resolve_assets_def("batch_files").op.pool == "gpu"  # a re-run of one file waits its turn too
    assert {"llm", "storage"} <= set(repo.get_top_level_resources())
    inference = definitions.resolve_assets_def("inference_results")
    assert inference.op.pool == "gpu"


_LATE_FILES: list[tuple[Path, str]] = []


class DropsAFileWhenTheModelLoads(SessionLLM):
    """Copies a batch file into the date's folder at the moment the engine is built (mid-run)."""

    def build_engine(self, kwargs):
        while _LATE_FILES:
            path, text = _LATE_FILES.pop()
            path.write_text(text)
        return super().build_engine(kwargs)


def test_a_file_arriving_mid_run_is_left_for_the_next_run(tiny_llm, tmp_path):
    """Defect: a file copied into the date's folder after the first step failed batch_outputs
    (FileNotFoundError on its validation.json). A run finishes exactly the batches it took."""
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "early.jsonl", [chat_line(f"e-{i}") for i in range(6)])
    _LATE_FILES.append((inbox / DATE / "late.jsonl", chat_line("l-1") + "\n" + chat_line("l-2") + "\n"))
    llm = tiny_llm.rebuilt(DropsAFileWhenTheModelLoads)

    first = materialize(llm, str(inbox), str(out))
    assert first.success
    assert (inbox / DATE / "late.jsonl").exists() and not _LATE_FILES  # it did arrive mid-run
    assert json.loads((out / DATE / "early" / "batch.json").read_text())["status"] == "completed"
    assert not (out / DATE / "late").exists()  # not touched by the run that did not take it
    for asset in ("validated_requests", "inference_results", "batch_outputs", "throughput_metrics"):
        assert metadata_of(first, asset)["batches"] == 1, asset
    record = json.loads((out / DATE / ".runs" / f"{first.run_id}.json").read_text())
    assert [b["name"] for b in record["batches"]] == ["early"]

    second = materialize(tiny_llm, str(inbox), str(out))  # the next run (nightly, backfill) takes it
    assert second.success
    assert json.loads((out / DATE / "late" / "batch.json").read_text())["request_counts"]["completed"] == 2
    assert metadata_of(second, "validated_requests")["batches_this_run"] == 1  # early is completed: skipped
    assert metadata_of(second, "validated_requests")["lines"] == 8  # the date's: early's 6 and late's 2


def test_a_later_step_without_the_first_fails_clearly(tiny_llm, partition_with_two_batches):
    inbox, out = partition_with_two_batches
    result = dg.materialize(
        BATCH_ASSETS,
        selection=["batch_outputs"],
        partition_key=DATE,
        resources={"batch": BatchSelection(), "llm": tiny_llm, "storage": StorageResource(input_path=str(inbox), output_path=str(out))},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert "materialize validated_requests in the same run first" in failure.step_failure_data.error.message


def test_a_run_with_nothing_to_do_leaves_results_and_figures_as_they_were(tiny_llm, tmp_path, monkeypatch):
    """Defect: a sensor run for a file a backfill had finished rewrote metrics.json and the
    throughput_metrics materialization with zeros (model load 0, inference 0, tok/s 0)."""
    inbox, out = tmp_path / "in", tmp_path / "out"
    path = write_batch(inbox / DATE, "night.jsonl", [chat_line(f"n-{i}") for i in range(4)])
    assert materialize(tiny_llm, str(inbox), str(out)).success  # the backfill
    folder = out / DATE / "night"
    before = {name: (folder / name).read_bytes() for name in ("output.jsonl", "errors.jsonl", "batch.json", "metrics.json")}
    assert json.loads(before["metrics.json"])["inference_seconds"] > 0

    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: pytest.fail("engine built"))
    # What the sensor's run for that file asks for: that one file, default config.
    again = materialize(tiny_llm, "", "", run_config=batch_run_config(str(path), str(folder)))
    assert again.success
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert metadata_of(again, "throughput_metrics") == {"batches": 0}  # no zeros in the UI's plots
    assert "inference_seconds" not in metadata_of(again, "inference_results")

    # Asked to redo it anyway: the answers are reused and the figures of the run that did the work stay.
    redo = batch_run_config(skip_completed=False)
    assert materialize(tiny_llm, str(inbox), str(out), run_config=redo).success
    assert (folder / "output.jsonl").read_bytes() == before["output.jsonl"]
    first, now = json.loads(before["metrics.json"]), json.loads((folder / "metrics.json").read_text())
    for key in ("model_load_seconds", "inference_seconds", "output_tokens_per_second", "peak_memory_mb"):
        assert now[key] == first[key], key


def test_a_gpu_preset_without_gpus_fails_the_step_once_before_any_model_loads(tiny_llm, tmp_path, monkeypatch):
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "a.jsonl", [chat_line("a-1")])
    monkeypatch.setenv("ENGINE_PRESET", "h100-8b")
    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: pytest.fail("engine built"))
    result = materialize(tiny_llm, str(inbox), str(out))
    assert not result.success
    failures = [e for e in result.all_events if e.is_step_failure]
    assert [e.step_key for e in failures] == ["inference_results"]
    assert "ENGINE_PRESET=h100-8b" in failures[0].step_failure_data.error.message
    assert not [e for e in result.all_events if e.event_type_value == "STEP_RESTARTED"]  # a setting: no retries


def test_date_figures_add_up_every_file_of_the_date_whichever_run_answered_it(tiny_llm, tmp_path):
    """Two sensor-style runs, one file each, on one date: the second run's throughput_metrics are the
    date's (both files), not that file's; the CLI's explicit output folder keeps a run's own figures."""
    inbox, out = tmp_path / "in", tmp_path / "out"
    first = write_batch(inbox / DATE, "first.jsonl", [chat_line(f"f-{i}") for i in range(3)])
    second = write_batch(inbox / DATE, "second.jsonl", [chat_line(f"s-{i}") for i in range(2)] + ["{broken"])
    one = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(str(first)))
    assert metadata_of(one, "throughput_metrics")["requests_completed"] == 3
    two = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(str(second)))
    figures = metadata_of(two, "throughput_metrics")
    per_file = [json.loads((out / DATE / name / "metrics.json").read_text()) for name in ("first", "second")]
    assert (figures["batches"], figures["batches_this_run"]) == (2, 1)
    assert (figures["requests_completed"], figures["requests_failed"]) == (5, 1)
    for key in ("output_tokens", "inference_seconds", "model_load_seconds"):
        assert figures[key] == pytest.approx(sum(m[key] for m in per_file), abs=0.002), key
    assert figures["output_tokens_per_second"] == pytest.approx(figures["output_tokens"] / figures["inference_seconds"], rel=0.01)
    assert figures["scope"].startswith(f"every batch of {DATE}")

    elsewhere = materialize(tiny_llm, "", "", run_config=batch_run_config(str(first), str(tmp_path / "cli-out")))
    own = metadata_of(elsewhere, "throughput_metrics")
    assert (own["batches"], own["requests_completed"]) == (1, 3) and own["scope"].startswith("this run's batches")


def test_the_check_judges_the_whole_date_and_passes_under_the_limit(tiny_llm, tmp_path, monkeypatch):
    """A sensor run for one file is judged with the date's other batches; a file over the limit
    alone is named even when the date passes."""
    monkeypatch.setenv("MAX_FAILED_LINE_RATE", "0.2")
    inbox, out = tmp_path / "in", tmp_path / "out"
    clean = write_batch(inbox / DATE, "clean.jsonl", [chat_line(f"c-{i}") for i in range(9)])
    noisy = write_batch(inbox / DATE, "noisy.jsonl", [chat_line("n-1"), "{broken"])
    first = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(str(clean)))
    [check] = first.get_asset_check_evaluations()
    assert check.passed and check.description == f"{DATE}: 0 of 9 lines failed (0.0%) in 1 batch(es); limit 20%"
    second = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(str(noisy)))
    [check] = second.get_asset_check_evaluations()
    assert check.passed and check.description.startswith(f"{DATE}: ")  # 1 of 11 lines: the date is fine
    assert check.description.startswith(f"{DATE}: 1 of 11 lines failed (9.1%) in 2 batch(es); limit 20%. Above it alone: noisy: 1 of 2")


def test_a_run_of_several_files_of_a_date_answers_those_alone(tiny_llm, tmp_path):
    """What the upload sensor asks for when files arrive together: one run (one model load), each
    file into its own folder, another file of the date left alone; a named file deleted since is
    left out with a warning, not a failure."""
    inbox, out = tmp_path / "in", tmp_path / "out"
    one = write_batch(inbox / DATE, "one.jsonl", [chat_line("o-1")])
    two = write_batch(inbox / DATE, "two.jsonl", [chat_line("t-1"), chat_line("t-2")])
    write_batch(inbox / DATE, "other.jsonl", [chat_line("x-1")])
    gone = inbox / DATE / "gone.jsonl"
    instance = dg.DagsterInstance.ephemeral()
    result = materialize(tiny_llm, str(inbox), str(out), instance=instance,
                         run_config=batch_run_config(input_uris=[str(one), str(two), str(gone)]))
    assert result.success
    assert sorted(p.name for p in (out / DATE).iterdir() if p.is_dir() and not p.name.startswith(".")) == ["one", "two"]
    assert [o["custom_id"] for o in read_jsonl(str(out / DATE / "two" / "output.jsonl"))] in (["t-1", "t-2"], ["t-2", "t-1"])
    assert metadata_of(result, "validated_requests")["batches"] == 2
    assert list((out / DATE / ".runs").glob("*.json"))  # the run's batch list, in the date's folder
    messages = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(m.endswith("gone.jsonl is gone since this run was requested; left out") for m in messages)

    clash = materialize(tiny_llm, str(inbox), str(out), run_config={"resources": {"batch": {"config": {
        "input_uris": [str(one)], "input_uri": str(two)}}}})
    assert not clash.success
    [failure] = [e for e in clash.all_events if e.is_step_failure]
    assert "leave input_uri and output_uri blank" in failure.step_failure_data.error.message


def test_a_passed_deadline_expires_the_unanswered_lines_without_loading_a_model(tiny_llm, tmp_path, monkeypatch):
    """The Batch API's completion window in the pipeline (batch.expires_at), with its endpoint
    (batch.endpoint): a run that starts past its deadline still validates (bad lines and lines of
    another url keep their own errors), loads no model, reports every valid line batch_expired and
    the batch expired; a later run without the deadline answers them."""
    inbox, out = tmp_path / "in", tmp_path / "out"
    embedding = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                            "body": {"model": TINY_NAME, "input": "x"}})
    write_batch(inbox / DATE, "late.jsonl", [chat_line("c1"), "{not json", embedding, chat_line("c2"), chat_line("c3")])
    deadline = int(time.time()) - 1
    engine_built = []
    build = type(tiny_llm).build_engine
    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: engine_built.append(kwargs))
    late = batch_run_config(endpoint="/v1/chat/completions", expires_at=deadline)
    result = materialize(tiny_llm, str(inbox), str(out), run_config=late)
    assert result.success and engine_built == []

    folder = out / DATE / "late"
    batch = json.loads((folder / "batch.json").read_text())
    assert batch["status"] == "expired" and batch["expired_at"] >= deadline and batch["expires_at"] == deadline
    assert batch["completed_at"] is None
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(str(folder / "errors.jsonl"))}
    assert errors["e"]["code"] == "url_mismatch" and errors["e"]["line"] == 3
    assert [errors[c]["code"] for c in ("c1", "c2", "c3")] == ["batch_expired"] * 3
    assert errors["c2"]["message"] == "line 4: the batch's completion window ended before this request ran"
    assert read_jsonl(str(folder / "output.jsonl")) == []
    table = pq.read_table(folder / "results.parquet").to_pydict()
    assert table["status"] == ["expired", "failed", "failed", "expired", "expired"]

    monkeypatch.setattr(type(tiny_llm), "build_engine", build)
    again = materialize(tiny_llm, str(inbox), str(out))  # no deadline: an expired batch is not completed
    assert again.success
    batch = json.loads((folder / "batch.json").read_text())
    assert batch["status"] == "completed" and batch["expired_at"] is None
    assert sorted(o["custom_id"] for o in read_jsonl(str(folder / "output.jsonl"))) == ["c1", "c2", "c3"]


def test_a_deadline_mid_batch_keeps_the_answers_so_far_and_expires_the_rest(tiny_llm, tmp_path):
    """Answering stops at the deadline: what was answered stays (output.jsonl, checkpoints), the
    rest is batch_expired, the batch expired; the next attempt resumes from those answers."""
    source = write_batch(tmp_path / "in", "b.jsonl", [chat_line("quick", max_tokens=1)]
                         + [chat_line(f"long-{i}", max_tokens=100, ignore_eos=True) for i in range(3)])
    loc = BatchLocation("b", str(source), str(tmp_path / "out"), DATE)
    validate_batch(loc, tiny_llm.validation_settings())
    identity = tiny_llm.identity()
    with tiny_llm.open(log=lambda _m: None) as engines:
        # 100 decoding steps of the long lines take well over 0.15 s; the quick line answers after one.
        first = infer_batch(loc, engines, identity, 256, 10.0, deadline=time.time() + 0.15)
        assert first["expired_at"] and first.get("finished_at") is None
        kept = first["computed_requests"]
        assert 1 <= kept < 4
        batch = finalize_batch(loc)
        assert batch["status"] == "expired"
        assert batch["request_counts"] == {"total": 4, "completed": kept, "failed": 4 - kept}
        outputs = read_jsonl(loc.out("output.jsonl"))
        assert "quick" in {o["custom_id"] for o in outputs}
        expired = [e for e in read_jsonl(loc.out("errors.jsonl")) if e["error"]["code"] == "batch_expired"]
        assert len(expired) == 4 - kept

        second = infer_batch(loc, engines, identity, 256, 10.0)
    assert second["resumed_requests"] == kept and second["computed_requests"] == 4 - kept
    batch = finalize_batch(loc)
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    again = {o["custom_id"]: o for o in read_jsonl(loc.out("output.jsonl"))}
    assert all(again[o["custom_id"]] == o for o in outputs)  # the answers kept are the ones served

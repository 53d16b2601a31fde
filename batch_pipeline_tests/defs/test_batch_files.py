"""Each batch file on its own: the batch_files partitions, their status from a date's run, a re-run of one file.

Covers, in-process (`dg.materialize` on a persistent test instance, the tiny model, real vLLM): a
date run registers one batch_files partition per file and marks each green, or not, by what happened
to that file; a broken file (every line invalid) fails alone; fixed, it is re-run alone from its
partition, which records that file only (the date stays as its failed run left it), and the date
run after it takes nothing, loads no model and records the date's batch_outputs, check and figures
over the whole date; per-date line counts on validated_requests and batch_outputs whichever runs answered the files; a
failed file's reason as a public observation of its partition (file_status.py); refusals of a bad key or a missing
file; the upload sensor adding the partitions of the files it queues. The UI itself: test_ui_walkthrough.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.defs import file_status
from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.partitions import batch_file_partitions, split_file_key
from batch_pipeline.defs.resources import BatchSelection, StorageResource
from batch_pipeline_tests.support.asset_runs import chat_line, metadata_of, write_batch

DATE = "2026-11-27"
FILES = dg.AssetKey("batch_files")


def resources(llm, inbox: Path, out: Path) -> dict:
    return {"batch": BatchSelection(), "llm": llm, "storage": StorageResource(input_path=str(inbox), output_path=str(out))}


def run_date(llm, inbox, out, instance, run_config=None):
    return dg.materialize(BATCH_ASSETS, partition_key=DATE, resources=resources(llm, inbox, out), instance=instance,
                          run_config=run_config, raise_on_error=False)


def run_file(llm, inbox, out, instance, key):
    return dg.materialize([batch_files, *BATCH_ASSETS], selection=[batch_files], partition_key=key,
                          resources=resources(llm, inbox, out), instance=instance, raise_on_error=False)


def status(instance: dg.DagsterInstance) -> dict[str, str]:
    keys = instance.get_dynamic_partitions(batch_file_partitions.name)
    found = instance.get_status_by_partition(FILES, keys, batch_file_partitions) or {}
    return {k: (v.value if v else "MISSING") for k, v in found.items()}


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as inst:
        yield inst


@pytest.fixture
def date_with_a_broken_file(tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "alpha.jsonl", [chat_line(f"a-{i}") for i in range(3)])
    write_batch(inbox / DATE, "beta.jsonl", [chat_line("b-1"), "{oops"])
    write_batch(inbox / DATE, "broken.jsonl", ["{not json", json.dumps({"custom_id": "x"})])  # every line invalid
    return inbox, out


def test_each_file_of_a_date_shows_alone_and_the_broken_one_reruns_alone(tiny_llm, instance, date_with_a_broken_file,
                                                                         monkeypatch):
    inbox, out = date_with_a_broken_file
    first = run_date(tiny_llm, inbox, out, instance)
    assert not first.success  # the broken file fails the date's run...
    assert status(instance) == {f"{DATE}/alpha": "MATERIALIZED", f"{DATE}/beta": "MATERIALIZED",
                                f"{DATE}/broken": "MISSING"}  # ...not materialized, its reason observed:
    [record] = instance.fetch_observations(dg.AssetRecordsFilter(FILES, asset_partitions=[f"{DATE}/broken"]),
                                           limit=5).records
    seen = record.asset_observation
    assert record.run_id == first.run_id
    why = {k: v.value for k, v in seen.metadata.items()}
    assert why["status"] == "failed" and why["invalid"] == 2 and why["first_error_lines"] == "1, 2"
    assert why["errors"] == str(out / DATE / "broken" / "errors.jsonl") and sum(why["error_codes"].values()) == 2
    assert why["run"] == first.run_id and why["job"] == first.dagster_run.job_name  # in-process: an ephemeral job
    records = instance.fetch_materializations(dg.AssetRecordsFilter(FILES, asset_partitions=[f"{DATE}/alpha"]), limit=1)
    alpha = records.records[0].asset_materialization
    assert alpha.metadata["status"].value == "completed" and alpha.metadata["completed"].value == 3
    assert alpha.metadata["results"].value == str(out / DATE / "alpha")

    # Fixed and re-run alone: no config, only its partition. It records that file, not the date.
    write_batch(inbox / DATE, "broken.jsonl", [chat_line("fixed-1"), chat_line("fixed-2")])
    rerun = run_file(tiny_llm, inbox, out, instance, f"{DATE}/broken")
    assert rerun.success
    assert status(instance) == {f"{DATE}/alpha": "MATERIALIZED", f"{DATE}/beta": "MATERIALIZED",
                                f"{DATE}/broken": "MATERIALIZED"}
    fixed = json.loads((out / DATE / "broken" / "batch.json").read_text())
    assert fixed["status"] == "completed" and fixed["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert json.loads((out / DATE / "alpha" / "batch.json").read_text())["metadata"]["dagster_run_id"] == first.run_id
    assert {e.asset_key for e in rerun.get_asset_materialization_events()} == {FILES}
    assert not rerun.get_asset_check_evaluations()
    assert "recorded again with this file by date_figures_sensor" in metadata_of(rerun, "batch_files")["date_assets"]
    date_assets = BATCH_ASSETS[2].partitions_def
    assert instance.get_status_by_partition(dg.AssetKey("batch_outputs"), [DATE], date_assets)[DATE].value == "FAILED"

    # The date run after it: nothing left to answer (no model load), the date recorded over its three files.
    monkeypatch.setattr(type(tiny_llm), "build_engine", lambda self, kwargs: pytest.fail("engine built"))
    date = run_date(tiny_llm, inbox, out, instance)
    monkeypatch.undo()
    assert date.success and "model_load_seconds" not in metadata_of(date, "inference_results")
    validated = metadata_of(date, "validated_requests")
    assert (validated["batches"], validated["lines"], validated["valid"], validated["batches_this_run"]) == (3, 7, 6, 0)
    outputs = metadata_of(date, "batch_outputs")
    assert (outputs["batches"], outputs["completed"], outputs["failed"], outputs["total"]) == (3, 6, 1, 7)
    assert outputs["batches_this_run"] == 0
    figures = metadata_of(date, "throughput_metrics")
    assert (figures["batches"], figures["requests_completed"], figures["requests_total"]) == (3, 6, 7)
    [check] = date.get_asset_check_evaluations()
    assert check.partition is None and check.check_name == "failed_line_rate" and check.passed is False  # 1 of 7
    assert "beta: 1 of 2" in check.description
    date_status = instance.get_status_by_partition(dg.AssetKey("batch_outputs"), [DATE], date_assets)
    assert date_status[DATE].value == "MATERIALIZED"  # red after the first run, green now

    # Re-running a completed file leaves it as it is.
    again = run_file(tiny_llm, inbox, out, instance, f"{DATE}/alpha")
    assert again.success
    assert json.loads((out / DATE / "alpha" / "batch.json").read_text())["metadata"]["dagster_run_id"] == first.run_id


def test_file_runs_turn_red_alone_and_the_dates_figures_follow_them(tiny_llm, instance, date_with_a_broken_file):
    """The new grain: each file its own run (as the sensor, the schedule and a backfill of batch_files
    launch them). The broken file's run fails with its reason as the failure's metadata, and its
    partition is FAILED (red) natively; date_figures_sensor's tick then records the date's
    batch_outputs, check and throughput over the three files, and after the fixed file's re-run,
    again, with nobody launching a date run."""
    from batch_pipeline.defs.date_figures import FiguresCursor, update_dates

    inbox, out = date_with_a_broken_file
    instance.add_dynamic_partitions(batch_file_partitions.name, [f"{DATE}/{n}" for n in ("alpha", "beta", "broken")])
    runs = {name: run_file(tiny_llm, inbox, out, instance, f"{DATE}/{name}") for name in ("alpha", "beta", "broken")}
    assert [runs[n].success for n in ("alpha", "beta", "broken")] == [True, True, False]
    assert status(instance) == {f"{DATE}/alpha": "MATERIALIZED", f"{DATE}/beta": "MATERIALIZED",
                                f"{DATE}/broken": "FAILED"}
    [failure] = runs["broken"].get_step_failure_events()
    data = failure.step_failure_data
    assert "broken of 2026-11-27 failed" in data.error.message and data.user_failure_data.description.startswith("broken")
    why = {k: v.value for k, v in data.user_failure_data.metadata.items()}
    assert why["status"] == "failed" and why["first_error_lines"] == "1, 2"
    assert why["errors"] == str(out / DATE / "broken" / "errors.jsonl")

    tick = update_dates(instance, FiguresCursor(), str(out))
    assert tick.files == {DATE: [f"{DATE}/alpha", f"{DATE}/beta", f"{DATE}/broken"]}
    for event in tick.events:  # recordable as the daemon records a sensor's asset events
        instance.report_runless_asset_event(event)
    by_key = {(type(e).__name__, e.asset_key.to_user_string()): e for e in tick.events}
    outputs = {k: v.value for k, v in by_key[("AssetMaterialization", "batch_outputs")].metadata.items()}
    assert (outputs["batches"], outputs["completed"], outputs["failed"], outputs["total"]) == (3, 4, 3, 7)
    assert by_key[("AssetMaterialization", "batch_outputs")].partition == DATE
    check = by_key[("AssetCheckEvaluation", "batch_outputs")]
    assert check.check_name == "failed_line_rate" and not check.passed and "broken: 2 of 2" in check.description
    figures = {k: v.value for k, v in by_key[("AssetMaterialization", "throughput_metrics")].metadata.items()}
    assert (figures["batches"], figures["requests_completed"], figures["requests_total"]) == (3, 4, 7)
    assert (out / DATE / "metrics.parquet").exists()
    assert update_dates(instance, tick.cursor, str(out)).files == {}  # each finished run once

    # Fixed and re-run alone: the file turns green, and the next tick records the date again.
    write_batch(inbox / DATE, "broken.jsonl", [chat_line("fixed-1"), chat_line("fixed-2")])
    assert run_file(tiny_llm, inbox, out, instance, f"{DATE}/broken").success
    assert status(instance)[f"{DATE}/broken"] == "MATERIALIZED"
    later = update_dates(instance, tick.cursor, str(out))
    assert later.files == {DATE: [f"{DATE}/broken"]}
    outputs = [e for e in later.events if e.asset_key.to_user_string() == "batch_outputs"
               and isinstance(e, dg.AssetMaterialization)][0]
    assert (outputs.metadata["completed"].value, outputs.metadata["failed"].value) == (6, 1)
    figures = [e for e in later.events if e.asset_key.to_user_string() == "throughput_metrics"][0]
    assert figures.metadata["requests_completed"].value == 6


def test_line_counts_are_the_dates_whichever_runs_answered_its_files(tiny_llm, instance, date_with_a_broken_file):
    inbox, out = date_with_a_broken_file
    (inbox / DATE / "broken.jsonl").unlink()
    one = run_date(tiny_llm, inbox, out, instance, batch_run_config(input_uri=str(inbox / DATE / "alpha.jsonl")))
    assert one.success
    assert metadata_of(one, "validated_requests")["lines"] == 3
    two = run_date(tiny_llm, inbox, out, instance, batch_run_config(input_uri=str(inbox / DATE / "beta.jsonl")))
    assert two.success
    validated = metadata_of(two, "validated_requests")
    assert (validated["batches"], validated["lines"], validated["valid"], validated["invalid"]) == (2, 5, 4, 1)
    assert validated["batches_this_run"] == 1
    outputs = metadata_of(two, "batch_outputs")
    assert (outputs["batches"], outputs["completed"], outputs["failed"], outputs["total"]) == (2, 4, 1, 5)
    # Runs with an explicit file still mark it in batch_files.
    assert status(instance) == {f"{DATE}/alpha": "MATERIALIZED", f"{DATE}/beta": "MATERIALIZED"}


def test_a_run_that_writes_elsewhere_has_no_file_partitions(tiny_llm, instance, date_with_a_broken_file, tmp_path):
    inbox, out = date_with_a_broken_file
    elsewhere = tmp_path / "elsewhere"
    result = run_date(tiny_llm, inbox, out, instance,
                      batch_run_config(input_uri=str(inbox / DATE / "alpha.jsonl"), output_uri=str(elsewhere)))
    assert result.success and (elsewhere / "batch.json").exists()
    assert instance.get_dynamic_partitions(batch_file_partitions.name) == []


@pytest.mark.parametrize("key, message", [
    ("alpha", "is not <YYYY-MM-DD>/<batch name>"),
    (f"{DATE}/gone", f"no batch file gone.jsonl (or .json, .ndjson, .parquet, .csv) of {DATE}"),
    ("2020-01-01/alpha", "2020-01-01 is outside the date partitions"),
])
def test_a_file_partition_that_cannot_run_says_why(tiny_llm, instance, date_with_a_broken_file, key, message):
    inbox, out = date_with_a_broken_file
    instance.add_dynamic_partitions(batch_file_partitions.name, [key])
    result = run_file(tiny_llm, inbox, out, instance, key)
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert message in failure.step_failure_data.error.message
    assert failure.step_failure_data.user_failure_data.description and not list((out).glob("**/batch.json"))


def test_a_launch_from_the_asset_graph_is_named_for_what_it_is():
    assert file_status.job_label("batch_job") == "batch_job"
    assert file_status.job_label("__ASSET_JOB") == (
        "__ASSET_JOB (launched from the asset graph; Dagster's UI names no job for it)")


def test_file_keys_round_trip():
    assert split_file_key(f"{DATE}/a/b") == (DATE, "a/b")
    with pytest.raises(ValueError, match="not <YYYY-MM-DD>/<batch name>"):
        split_file_key(f"{DATE}/")


# One file run in a process of its own, as the daemon launches one: its partition added to the
# instance under DAGSTER_HOME, then materialized; the environment says where the files and engine are.
FILE_RUN = """
import sys
import dagster as dg
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
key = sys.argv[1]
with dg.DagsterInstance.get() as instance:
    instance.add_dynamic_partitions("batch_files", [key])
    result = dg.materialize([batch_files], partition_key=key, instance=instance, raise_on_error=False,
                            resources={"batch": BatchSelection(), "llm": LLMResource(), "storage": StorageResource()})
sys.exit(0 if result.success else 1)
"""


def test_file_runs_on_the_warm_engine_killed_cancelled_and_left_alone(warm_engine_url, tiny_model_dir, tmp_path):
    """Three file runs of one date side by side on the test run's warm engine, each in its own
    process: one killed with SIGKILL mid-answers and run again answers every line once (resumed
    from its checkpoints); one cancelled (SIGINT, as a terminate) says cancelled and keeps its
    answers; the third, beside both, completes untouched."""
    import signal
    import subprocess
    import sys

    from batch_pipeline_tests.support.cli_runs import answered_once, part_files, read_results
    from batch_pipeline_tests.support import tiny_env, wait_for

    inbox, out, home = tmp_path / "in", tmp_path / "out", tmp_path / "home"
    home.mkdir()
    # The cancelled file is the longest: it is stopped after the killed one is handled, and a warm run
    # (no torch to import) could otherwise be through its 160 lines by then.
    ids = {name: [f"{name}-{i:03d}" for i in range(480 if name == "cancelled" else 160)]
           for name in ("killed", "cancelled", "alone")}
    for name, names in ids.items():
        write_batch(inbox / DATE, f"{name}.jsonl", [chat_line(i, max_tokens=16, ignore_eos=True) for i in names])
    env = tiny_env(tiny_model_dir, DAGSTER_HOME=str(home), ENGINE_URL=warm_engine_url, ENGINE_WINDOW="4",
                   CHECKPOINT_ANSWERS="20", STORAGE_INPUT_PATH=str(inbox), STORAGE_OUTPUT_PATH=str(out),
                   PARTITIONS_START="2026-11-01")

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", FILE_RUN, f"{DATE}/{name}"], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    # The instance (SQLite under DAGSTER_HOME) made once first: three processes creating it at once race
    # in its schema migration.
    subprocess.run([sys.executable, "-c", "import dagster as dg; dg.DagsterInstance.get().add_dynamic_partitions("
                    f"'batch_files', {[f'{DATE}/{n}' for n in ids]!r})"], env=env, check=True, timeout=120)
    runs = {name: start(name) for name in ("killed", "alone", "cancelled")}
    try:
        for name, sig in (("killed", signal.SIGKILL), ("cancelled", signal.SIGINT)):
            wait_for(f"{name}'s first two checkpoint parts",
                     lambda: len(part_files(out / DATE / name)) >= 2 or runs[name].poll() is not None, 240, interval=0.2)
            assert runs[name].poll() is None, f"{name}'s run ended before it could be stopped: {runs[name].stderr.read()[-2000:]}"
            os.killpg(runs[name].pid, sig)
        assert runs["killed"].wait(60) == -signal.SIGKILL
        assert runs["cancelled"].wait(120) == 1  # the run failed: cancelled
        assert runs["alone"].wait(300) == 0, runs["alone"].stderr.read()[-2000:]
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait(30)

    outputs, errors, batch = read_results(out / DATE / "alone")
    answered_once(outputs, errors, ids["alone"])
    assert batch["status"] == "completed"
    cancelled = json.loads((out / DATE / "cancelled" / "batch.json").read_text())
    assert cancelled["status"] == "cancelled" and 0 < cancelled["request_counts"]["completed"] < 160
    saved = sum(p.read_text().count("\n") for p in part_files(out / DATE / "killed"))
    assert 0 < saved < 160 and not (out / DATE / "killed" / "batch.json").exists()

    again = start("killed")
    assert again.wait(300) == 0, again.stderr.read()[-2000:]
    outputs, errors, batch = read_results(out / DATE / "killed")
    answered_once(outputs, errors, ids["killed"])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 160
    assert json.loads((out / DATE / "killed" / "metrics.json").read_text())["resumed_requests"] >= saved

"""A cancel whose interrupt never reaches the run still stops it (defs/run_watch.py).

Dagster terminates a run by marking it CANCELING and then asking the code server to interrupt the
worker; the failure injected here is the second move lost: the run is marked CANCELING in its real
instance and nothing else is sent. Covered: the watch itself on a real (ephemeral) instance (quiet
while the run is started, and for the grace after CANCELING; then it says so and logs why), and a
whole in-process run of the four assets on the tiny model marked cancelling mid-answering: the run
ends CANCELED soon after, the batch is reported cancelled with every answer it had kept, the step
names the cancel, and the next run answers only the rest. Dagster's own interrupt path is covered by
test_engine_multiprocess.py and test_batch_api.py.
"""

from __future__ import annotations

import json
import threading
import time

import dagster as dg

from batch_pipeline.defs import run_watch
from batch_pipeline.defs.run_watch import (ANSWERING_TAG, PRIORITY_POLL_SECONDS, WARM_ENGINE_TAG, CancelWatch,
                                           PriorityWatch, tag_run)
from batch_pipeline.config.priority import priority_tags
from batch_pipeline_tests.support.asset_runs import DATE, chat_line, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import wait_for


LINES = 160


def started_run(instance: dg.DagsterInstance) -> dg.DagsterRun:
    run = dg.DagsterRun(job_name="batch_job", run_id="watch-run", status=dg.DagsterRunStatus.STARTED)
    return instance.add_run(run)


def test_the_watch_is_quiet_while_started_and_speaks_after_the_grace_of_cancelling(tmp_path):
    # SQLite files, as a deployment's run storage: the ephemeral instance's in-memory tables refuse a
    # write at once ("database table is locked") while the watch's thread reads them
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        run = started_run(instance)
        said: list[str] = []
        watch = CancelWatch(instance, run.run_id, said.append, poll=0.02, grace=0.5)
        with watch.running():
            time.sleep(0.3)  # a dozen polls of a started run
            assert not watch.requested() and said == []
            instance.report_run_canceling(run)
            marked = time.monotonic()
            wait_for("the watch to see the cancel", watch.requested, timeout=10, interval=0.01)
            assert time.monotonic() - marked >= 0.5  # not before the grace: Dagster's interrupt comes first
        assert len(said) == 1 and "cancelling for over 0.5s" in said[0] and "every answer so far is kept" in said[0]


def test_a_run_tags_itself_while_its_watch_reads_a_throwaway_instance():
    """`batch-pipeline run` without DAGSTER_HOME runs on Dagster's ephemeral instance, whose in-memory
    tables refuse a write at once while another thread reads them: the answering tag written beside a
    watch reading without pause (here 24 of 200 plain writes were refused) is tried again."""
    with dg.DagsterInstance.ephemeral() as instance:
        run = started_run(instance)
        with CancelWatch(instance, run.run_id, lambda said: None, poll=0).running():
            for i in range(200):
                tag_run(instance, run.run_id, {ANSWERING_TAG: f"http://127.0.0.1:{8000 + i}"})
        assert instance.get_run_by_id(run.run_id).tags[ANSWERING_TAG] == "http://127.0.0.1:8199"


def test_a_run_marked_cancelling_without_its_interrupt_stops_keeps_its_answers_and_resumes(tiny_llm, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(run_watch, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(run_watch, "GRACE_SECONDS", 0.2)
    monkeypatch.setenv("CHECKPOINT_ANSWERS", "1")  # every answer is in a part file as soon as it is given
    inbox, out = tmp_path / "in", tmp_path / "out"
    # Lengths from 4 to 202 tokens: answers keep arriving for seconds, the longest last.
    lines = [chat_line(f"c{i}", max_tokens=4 + 2 * (i % 100), ignore_eos=True) for i in range(LINES)]
    write_batch(inbox / DATE, "long.jsonl", lines)
    # SQLite files rather than the ephemeral instance's in-memory tables, which refused this thread's
    # write while the run's cancel watch read them ("database table is locked": CI of stop 52)
    (tmp_path / "dagster").mkdir()
    instance = dg.DagsterInstance.local_temp(str(tmp_path / "dagster"))
    marked: dict[str, object] = {}

    def cancel_without_interrupt() -> None:
        try:
            wait_for("a first checkpointed answer", lambda: any(out.rglob("part-*.jsonl")), timeout=300, interval=0.02)
            [run] = instance.get_runs()
            instance.report_run_canceling(run)  # what the terminate mutation does first; the interrupt never follows
            marked["at"] = time.monotonic()
        except Exception as error:  # noqa: BLE001 - reported by the assertion below, not lost with the thread
            marked["error"] = repr(error)

    canceller = threading.Thread(target=cancel_without_interrupt, daemon=True)
    canceller.start()
    result = materialize(tiny_llm, str(inbox), str(out), instance=instance)
    ended = time.monotonic()
    canceller.join(timeout=5)
    assert "at" in marked and not result.success, marked
    assert ended - marked["at"] < 30  # a few polls, then the next answer: not the rest of the batch
    assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.CANCELED
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    assert failure.step_key == "inference_results" and "cancelled: long" in failure.step_failure_data.error.message
    warnings = [e.message for e in instance.all_logs(result.run_id) if e.level == 30]  # logging.WARNING
    assert any("without Dagster's interrupt reaching it" in (m or "") for m in warnings), warnings

    folder = out / DATE / "long"
    batch = json.loads((folder / "batch.json").read_text())
    kept = batch["request_counts"]["completed"]
    assert batch["status"] == "cancelled" and 1 <= kept < LINES
    assert len(read_jsonl(str(folder / "output.jsonl"))) == kept

    again = materialize(tiny_llm, str(inbox), str(out))
    assert again.success
    inference = json.loads(next(out.rglob("inference.json")).read_text())
    assert inference["resumed_requests"] == kept and inference["computed_requests"] == LINES - kept
    assert json.loads((folder / "batch.json").read_text())["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}


def test_a_run_sees_a_more_urgent_run_answering_on_its_engine_and_only_that(tmp_path):
    url, other = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
    # SQLite files, as a deployment's run storage: the ephemeral instance's in-memory tables refuse a
    # write at once ("database table is locked") while the watch's thread reads them (CI, 2026-12-06)
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        bulk = instance.add_run(dg.DagsterRun(job_name="batch_job", run_id="bulk", status=dg.DagsterRunStatus.STARTED,
                                              tags=priority_tags(1)))

        def run(run_id: str, priority: int, status: dg.DagsterRunStatus, answering_on: str) -> None:
            instance.add_run(dg.DagsterRun(job_name="batch_job", run_id=run_id, status=status,
                                           tags={**priority_tags(priority), ANSWERING_TAG: answering_on}))

        watch = PriorityWatch(instance, bulk, url, poll=0.02)
        with watch.answering():
            assert instance.get_run_by_id("bulk").tags[ANSWERING_TAG] == url
            run("same", 1, dg.DagsterRunStatus.STARTED, url)  # equal priority: no yielding
            run("lower", 0, dg.DagsterRunStatus.STARTED, url)
            run("elsewhere", 10, dg.DagsterRunStatus.STARTED, other)  # another engine
            run("finished", 10, dg.DagsterRunStatus.SUCCESS, url)  # no longer answering
            time.sleep(0.2)  # ten polls: none of these outranks the bulk run
            assert watch.outranked() is None
            run("urgent", 5, dg.DagsterRunStatus.STARTED, url)
            wait_for("the urgent run seen", watch.outranked, timeout=10, interval=0.01)
            assert watch.outranked() == f"run urgent (priority 5, this run's 1) is answering on {url}"
            instance.add_run_tags("urgent", {ANSWERING_TAG: ""})  # what its own watch does when it stops answering
            wait_for("the urgent run gone", lambda: watch.outranked() is None, timeout=10, interval=0.01)
        assert instance.get_run_by_id("bulk").tags[ANSWERING_TAG] == ""


def test_a_more_urgent_run_counts_from_its_launch_until_it_answers_or_its_grace_ends(tmp_path):
    """A run launched to answer on the engine (WARM_ENGINE_TAG, as both jobs carry it) outranks the
    bulk run from STARTING on, before it tags itself answering; one bound for another engine does
    not, nor one that has finished answering, nor one started longer than STARTING_GRACE_SECONDS ago
    that never began (its lines all elsewhere, a long validation). (A queued run is not read at all:
    the look asks for STARTING and STARTED runs.)"""
    url = "http://127.0.0.1:8000"
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        bulk = instance.add_run(dg.DagsterRun(job_name="batch_job", run_id="bulk", status=dg.DagsterRunStatus.STARTED,
                                              tags={**priority_tags(0), WARM_ENGINE_TAG: url}))

        def run(run_id: str, status: dg.DagsterRunStatus, **tags: str) -> None:
            instance.add_run(dg.DagsterRun(job_name="batch_job", run_id=run_id, status=status,
                                           tags={**priority_tags(10), **tags}))

        watch = PriorityWatch(instance, bulk, url)
        run("elsewhere", dg.DagsterRunStatus.STARTING, **{WARM_ENGINE_TAG: "http://127.0.0.1:8001"})
        run("done-answering", dg.DagsterRunStatus.STARTED, **{WARM_ENGINE_TAG: url, ANSWERING_TAG: ""})
        run("in-process", dg.DagsterRunStatus.STARTING)
        assert watch.look() is None
        run("urgent", dg.DagsterRunStatus.STARTING, **{WARM_ENGINE_TAG: url})
        assert watch.look() == f"run urgent (priority 10, this run's 0) is starting on {url}"
        instance.add_run_tags("urgent", {ANSWERING_TAG: url})  # its inference step began
        assert watch.look() == f"run urgent (priority 10, this run's 0) is answering on {url}"
        instance.add_run_tags("urgent", {ANSWERING_TAG: ""})  # and ended
        assert watch.look() is None
        run("slow-starter", dg.DagsterRunStatus.STARTING, **{WARM_ENGINE_TAG: url})
        assert watch.look() == f"run slow-starter (priority 10, this run's 0) is starting on {url}"
        # Within its grace (its launch is recorded to the second), and past it without answering.
        assert watch.look(now=time.time() + run_watch.STARTING_GRACE_SECONDS - 15) is not None
        assert watch.look(now=time.time() + run_watch.STARTING_GRACE_SECONDS + 15) is None


def test_both_jobs_tell_which_warm_engine_their_runs_answer_on(monkeypatch):
    from batch_pipeline.defs.jobs import warm_engine_tags

    monkeypatch.setenv("ENGINE_URL", "http://engine:8000/v1/")
    assert warm_engine_tags() == {WARM_ENGINE_TAG: "http://engine:8000"}  # as the runs' watches name it
    monkeypatch.setenv("ENGINE_URL", "engine:8000")  # refused when the run starts, saying why
    assert warm_engine_tags() == {}
    monkeypatch.delenv("ENGINE_URL")
    assert warm_engine_tags() == {}


def test_a_watch_among_many_runs_on_its_engine_looks_less_often(tmp_path):
    """Every run's watch reads all the runs answering on the engine: at 100 runs, a look a second each
    fell behind (bench/priority_watch_load.py). A watch seeing K runs waits K / 25 s (at least its poll),
    so an engine's watches look about 25 times a second in all."""
    url = "http://127.0.0.1:8000"
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        runs = [instance.add_run(dg.DagsterRun(job_name="batch_job", run_id=f"r{i}", status=dg.DagsterRunStatus.STARTED,
                                               tags={**priority_tags(0), ANSWERING_TAG: url})) for i in range(50)]
        watch = PriorityWatch(instance, runs[0], url)
        assert watch.interval() == PRIORITY_POLL_SECONDS == 0.25  # before its first look: the poll
        assert watch.look() is None
        assert watch.interval() == 2.0  # 50 runs answering: 50 / 25 s
        for run in runs[10:]:
            instance.add_run_tags(run.run_id, {ANSWERING_TAG: ""})  # 40 of them stopped answering
        watch.look()
        assert watch.interval() == 0.4  # 10 runs: 10 / 25 s
        for run in runs[5:10]:
            instance.add_run_tags(run.run_id, {ANSWERING_TAG: ""})
        watch.look()
        assert watch.interval() == PRIORITY_POLL_SECONDS  # 5 runs: 5 / 25 s is shorter than the poll

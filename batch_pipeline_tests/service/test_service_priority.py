"""Batch priority and per-tenant fair share: `batch-pipeline serve` over a real `dagster dev` (its
daemon's run queue, the QueuedRunCoordinator) and real runs on the tiny model, driven by the openai SDK.

Covered: `metadata["priority"]` (a string of digits as the SDK sends it, or an integer) checked and
capped per tenant (BATCH_API_MAX_PRIORITY, BATCH_API_TENANT_MAX_PRIORITY; 400 naming the field or the
cap), kept in the Batch object's metadata and the service's record, and given to the run in its
`dagster/priority` tag (priority x 1,000,000 - turn); a high-priority batch submitted behind
low-priority ones of the same tenant is the one the queue starts next; two tenants' backlogs of equal
priority start in turn (b, a, b, a), not in the order they were submitted (a, a, b, b); one tenant's queued backlog does not
hold another tenant's batch back (the repo dagster.yaml's per-tenant `tag_concurrency_limits`, also
present, under the run limit, in deploy/dagster.yaml and the Helm values); the settings refused
naming the variable.

The instance is the repo's dagster.yaml with its limits made small enough to fill with a few runs:
`max_concurrent_runs: 2` and one run in progress per tenant (the repo has 4 and 2), and the `gpu` pool
as the Helm values have it, `granularity: run` with room for both (2): a run waits in the queue, not
in a started run blocked on the pool (where a cancel is not seen until the pool frees). The daemon
looks at its queue every second (the repo's `run_queue: dequeue_interval_seconds: 1`; Dagster's default is 5), so a wait for
what it has not started is 3 s, not 7. Runs that would take long are cancelled once they have shown
what they show; none is answered to the end here. Batches whose runs only have to start (or to take a
slot) hold one line the run refuses (`refused_line`): their runs end at validation without importing
vLLM, the cost that made up most of a run here. The one that holds a run slot to the end of a
test runs at nice 19 (`lower_priority`), so the runs the test watches get the CPU; cancels go to the
queued runs first, so a slot freed by a cancel starts none of them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from batch_pipeline_tests.support.api_service import (RUN_TIMEOUT, batch_runs, client, lower_priority, refused_line, request_line,
                                              run_status, serve_env, service_stack, upload, wait_run_status)
from batch_pipeline_tests.support import REPO, wait_for

KEY_A, KEY_B, KEY_C = "key-prio-a-0123456789", "key-prio-b-0123456789", "key-prio-c-0123456789"
TENANT_TAG = "batch_pipeline/tenant"
IN_PROGRESS = ("STARTING", "STARTED")
ENDED = ("CANCELED", "FAILURE", "SUCCESS")
DEQUEUE_INTERVAL = 1  # seconds between the daemon's looks at its queue (the instance's; Dagster's default 5)
DEQUEUE_WAIT = 3.0  # three of its looks: a run it could start, it has started (slept as a window in which nothing may start)


@pytest.fixture(scope="module")
def queue(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("priority")
    settings = yaml.safe_load((REPO / "dagster.yaml").read_text())
    runs = settings["concurrency"]["runs"]
    [per_tenant] = [limit for limit in runs["tag_concurrency_limits"] if limit["key"] == TENANT_TAG]
    assert per_tenant["value"] == {"applyLimitPerUniqueValue": True}  # one limit for each tenant, not for all
    runs["max_concurrent_runs"], per_tenant["limit"] = 2, 1
    settings["concurrency"]["pools"] = {"default_limit": 2, "granularity": "run"}
    assert settings["run_queue"]["dequeue_interval_seconds"] == DEQUEUE_INTERVAL  # the repo's own
    instance_yaml = root / "dagster.yaml"
    instance_yaml.write_text(yaml.safe_dump(settings))
    extra = {"BATCH_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B},team-c:{KEY_C}",
             "BATCH_API_MAX_PRIORITY": "5", "BATCH_API_TENANT_MAX_PRIORITY": "team-c:0"}
    with service_stack(root, tiny_model_dir, extra, instance_yaml=instance_yaml, engine_url=warm_engine_url) as stack:
        yield stack


def long_lines(tag: str) -> list[str]:
    """Over ten minutes of answering on the tiny model (800 of these lines took 84 s on 2 cores): the run
    stays in progress until it is cancelled."""
    return [request_line(f"{tag}-{i}", max_tokens=256) for i in range(10_000)]


def create(sdk: openai.OpenAI, file_id: str, **metadata: Any) -> Any:
    return sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata=metadata or None)


def cancel_all(queue: dict[str, Any], batches: list[tuple[openai.OpenAI, str]]) -> None:
    """Cancel the batches (each with its tenant's client) and wait until none of their runs is left in
    the queue or in progress. Every poll asks for the queued ones first: a cancelled run frees a slot,
    which the daemon would otherwise give to one of them, and that run would have to come up before it
    could be cancelled. Dagster refuses to terminate a run while it is STARTING (the service then waits,
    and terminates it on the batch's next read): that one is asked again once it has started."""
    server = queue["server"]
    asked: set[str] = set()

    def ended() -> bool:
        statuses = {batch_id: run_status(server, batch_id) for _, batch_id in batches}
        for wanted in ("QUEUED", "STARTED"):
            for sdk, batch_id in batches:
                if batch_id not in asked and statuses[batch_id] == wanted:
                    try:
                        sdk.batches.cancel(batch_id)
                        asked.add(batch_id)
                    except (openai.InternalServerError, openai.BadRequestError):  # STARTING, or just ended
                        pass
        for sdk, batch_id in batches:
            if batch_id in asked and statuses[batch_id] not in ENDED:
                sdk.batches.retrieve(batch_id)  # a cancel that came while the run was starting: it terminates it
        return all(status in ENDED for status in statuses.values())

    def what_happened() -> str:  # if it ever hangs again: each run's status and its last events, the service's log
        lines = []
        for _, batch_id in batches:
            run = batch_runs(server, batch_id)[0]
            events = [f"    {entry.dagster_event_type or 'log'}: {(entry.message or '')[:200]}"
                      for entry in server.instance().all_logs(run["runId"])[-12:]]
            lines += [f"{batch_id} run {run['runId']} {run['status']} (cancel asked: {batch_id in asked})", *events]
        service_log = Path(queue["log"]).read_text(errors="replace").splitlines()[-30:]
        return "\n".join(lines + ["serve.log:", *service_log, "dagster dev:", server.log_tail(30)])

    wait_for(f"the runs of batches {[batch_id for _, batch_id in batches]} ended", ended, RUN_TIMEOUT, interval=0.5,
             on_timeout=what_happened)


def test_priority_is_checked_capped_and_given_to_the_run(queue):
    a, c = client(queue["url"], KEY_A), client(queue["url"], KEY_C)
    uploaded = upload(a, [refused_line("p-1")])
    for value, message in [("high", "metadata.priority 'high' is not a whole number"),
                           ("1.5", "metadata.priority '1.5' is not a whole number"),
                           ("6", "metadata.priority 6 is above this tenant's highest priority, 5"),
                           ("-1001", "metadata.priority -1001 is below the lowest priority, -1000")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(message)) as refused:
            create(a, uploaded.id, priority=value)
        assert refused.value.param == "metadata.priority"
    with pytest.raises(openai.BadRequestError, match=re.escape("above this tenant's highest priority, 0")):
        create(c, upload(c, [refused_line("p-2")]).id, priority="1")  # BATCH_API_TENANT_MAX_PRIORITY=team-c:0
    assert a.batches.list().data == [] and c.batches.list().data == []  # a refused batch leaves no record

    batch = create(a, uploaded.id, priority="5", job="nightly")
    assert batch.metadata == {"priority": "5", "job": "nightly"}
    [run] = batch_runs(queue["server"], batch.id)
    assert run["tags"][TENANT_TAG] == "team-a"
    # Nothing else of priority 5 queued: turn 0.
    assert {k: run["tags"][k] for k in ("dagster/priority", "batch_pipeline/priority", "batch_pipeline/turn")} == {
        "dagster/priority": "5000000", "batch_pipeline/priority": "5", "batch_pipeline/turn": "0"}
    [record] = (queue["out"] / "_batch_api" / "batches").glob(f"{batch.id}.json")
    assert {k: json.loads(record.read_text())[k] for k in ("priority", "turn")} == {"priority": 5, "turn": 0}
    assert a.batches.retrieve(batch.id).metadata == {"priority": "5", "job": "nightly"}
    # An integer (a client other than the SDK may send one) is kept as the SDK's metadata: a string.
    # Below 0 is always allowed (behind the default); team-c's cap is 0.
    low = create(c, upload(c, [refused_line("p-3")]).id, priority=-3)
    assert low.metadata == {"priority": "-3"}
    assert batch_runs(queue["server"], low.id)[0]["tags"]["dagster/priority"] == "-3000000"
    # No priority: 0, and the metadata stays as given.
    plain = create(c, upload(c, [refused_line("p-4")]).id, job="x")
    assert plain.metadata == {"job": "x"} and batch_runs(queue["server"], plain.id)[0]["tags"]["dagster/priority"] == "0"
    cancel_all(queue, [(c, plain.id), (c, low.id), (a, batch.id)])


def start_times(server: Any, batch_ids: list[str], field: str = "startTime") -> dict[str, float | None]:
    """When each batch's run started (Dagster's run record; `field="endTime"`: ended), by batch id."""
    times = {}
    for batch_id in batch_ids:
        run_id = batch_runs(server, batch_id)[0]["runId"]
        run = server.graphql(f"query($id: ID!) {{ runOrError(runId: $id) {{ ... on Run {{ {field} }} }} }}",
                             {"id": run_id})["runOrError"]
        times[batch_id] = run[field]
    return times


def test_two_tenants_backlogs_start_in_turn(queue):
    """Both run slots held (team-c's and team-a's long batches), team-a queues two batches, then team-b
    two: once team-a's long batch is cancelled the one free slot takes them b, a, b, a (team-a had the
    turn in progress), not in the order they came (a, a, b, b)."""
    a, b, c = (client(queue["url"], key) for key in (KEY_A, KEY_B, KEY_C))
    server = queue["server"]
    c_busy, a_busy = create(c, upload(c, long_lines("c-busy")).id), create(a, upload(a, long_lines("a-busy")).id)
    a_queued, b_queued = [], []
    try:
        for batch in (c_busy, a_busy):
            wait_run_status(server, batch.id, ("STARTED",))
        # team-c's holds a slot to the end: the queued runs get the CPU. (team-a's is cancelled next, at
        # full speed: at nice 19 on a loaded machine a run took 33 s to end.)
        lower_priority(server, c_busy.id)
        a_file, b_file = upload(a, [refused_line("turn-a")]).id, upload(b, [refused_line("turn-b")]).id
        a_queued = [create(a, a_file) for _ in range(2)]
        b_queued = [create(b, b_file) for _ in range(2)]
        turns = {batch.id: batch_runs(server, batch.id)[0]["tags"]["batch_pipeline/turn"] for batch in a_queued + b_queued}
        assert list(turns.values()) == ["1", "2", "0", "1"], turns
        assert [run_status(server, batch.id) for batch in a_queued + b_queued] == ["QUEUED"] * 4
        cancel_all(queue, [(a, a_busy.id)])
        for batch in a_queued + b_queued:  # each ends at validation (refused_line), and the next starts
            wait_run_status(server, batch.id, ("FAILURE",))
        # Else two slots were free at the end and the per-tenant cap alone could have alternated them.
        assert run_status(server, c_busy.id) == "STARTED", "team-c's long batch ended: the queue had two slots"
        started = start_times(server, [batch.id for batch in a_queued + b_queued])
        order = sorted(started, key=started.__getitem__)
        owner = {**{batch.id: "a" for batch in a_queued}, **{batch.id: "b" for batch in b_queued}}
        assert [owner[batch_id] for batch_id in order] == ["b", "a", "b", "a"], order
        # Within a tenant, first come first served.
        assert [batch_id for batch_id in order if owner[batch_id] == "a"] == [batch.id for batch in a_queued]
    finally:
        cancel_all(queue, [(a, batch.id) for batch in a_queued] + [(b, batch.id) for batch in b_queued]
                   + [(a, a_busy.id), (c, c_busy.id)])


def test_a_tenants_backlog_waits_for_its_one_run_holds_no_other_tenant_back_and_starts_high_priority_first(queue):
    """team-a's runs go one at a time (one run per tenant here): while its first batch runs, two
    batches without priority and then one of priority 5 wait, although a run slot is free; team-b's
    batch, submitted after them, starts at once (one tenant's queued backlog does not hold another
    tenant's batch back); when team-a's first batch ends, the queue starts the priority-5 batch, not the
    oldest. (One test: both halves need team-a's long batch in progress, and it takes a run worker and
    an engine to get there.)"""
    sdk, sdk_b, server = client(queue["url"], KEY_A), client(queue["url"], KEY_B), queue["server"]
    busy = create(sdk, upload(sdk, long_lines("busy")).id)
    wait_run_status(server, busy.id, ("STARTED",))  # not niced: it is cancelled below and ends sooner so
    small = upload(sdk, [request_line("q-1")]).id
    low_1, low_2 = create(sdk, small), create(sdk, small)
    high = create(sdk, small, priority="5")
    b_first = None
    try:
        time.sleep(DEQUEUE_WAIT)  # a run slot is free (2), but team-a has its one run in progress
        assert [run_status(server, b.id) for b in (busy, low_1, low_2, high)] == ["STARTED", "QUEUED", "QUEUED", "QUEUED"]
        # team-b's batch, submitted after team-a's backlog, starts at once; team-a's still wait.
        b_first = create(sdk_b, upload(sdk_b, [refused_line("b1")]).id)
        wait_run_status(server, b_first.id, (*IN_PROGRESS, *ENDED))
        assert run_status(server, busy.id) in IN_PROGRESS
        assert [run_status(server, batch.id) for batch in (low_1, low_2, high)] == ["QUEUED"] * 3
        time.sleep(DEQUEUE_WAIT)
        # still: the limit, not the daemon's pace
        assert [run_status(server, batch.id) for batch in (low_1, low_2, high)] == ["QUEUED"] * 3
        sdk.batches.cancel(busy.id)  # STARTED: Dagster terminates it

        def started_after_cancel() -> list[str]:
            # Read the batch as a client polling it would: a cancel that arrived while the service still
            # saw its run as starting is carried out on the next read (test_service_cancel.py).
            sdk.batches.retrieve(busy.id)
            return [b.id for b in (low_1, low_2, high) if run_status(server, b.id) != "QUEUED"]

        first = wait_for("a queued batch started", started_after_cancel, RUN_TIMEOUT, interval=0.5,
                         on_timeout=server.log_tail)
        assert first == [high.id], first
        assert run_status(server, busy.id) in ENDED
        # and the low ones wait behind it (team-a's one run): neither starts before it has ended (a one-line
        # batch on the warm engine may end within a few looks of the queue, and then the next may start)
        wait_run_status(server, high.id, ENDED)
        high_end = start_times(server, [high.id], "endTime")[high.id]
        time.sleep(DEQUEUE_WAIT)
        lows = start_times(server, [low_1.id, low_2.id])
        assert all(started is None or started >= high_end for started in lows.values()), (high_end, lows)
    finally:
        cancel_all(queue, [(sdk, batch.id) for batch in (low_1, low_2, high, busy)] + ([(sdk_b, b_first.id)] if b_first else []))


@pytest.mark.server  # `batch-pipeline serve` in its own process (no fixture says so)
def test_priority_settings_are_checked_naming_the_variable(tmp_path):
    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.service.app import load_priority_caps

    tenants = {"team-a", "team-b"}
    assert load_priority_caps(tenants, {}) == (0, {})
    assert load_priority_caps(tenants, {"BATCH_API_MAX_PRIORITY": "3",
                                        "BATCH_API_TENANT_MAX_PRIORITY": "team-a:10, team-b:0"}) == (3, {"team-a": 10,
                                                                                                       "team-b": 0})
    for env, message in [({"BATCH_API_MAX_PRIORITY": "-1"}, "BATCH_API_MAX_PRIORITY='-1' is out of range (0 to 1000"),
                         ({"BATCH_API_MAX_PRIORITY": "2000000"}, "BATCH_API_MAX_PRIORITY='2000000'"),
                         ({"BATCH_API_TENANT_MAX_PRIORITY": "team-a"}, "BATCH_API_TENANT_MAX_PRIORITY: 'team-a' is not tenant:cap"),
                         ({"BATCH_API_TENANT_MAX_PRIORITY": "team-x:1"},
                          "BATCH_API_TENANT_MAX_PRIORITY: tenant 'team-x' has no API key"),
                         ({"BATCH_API_TENANT_MAX_PRIORITY": "team-a:top"}, "BATCH_API_TENANT_MAX_PRIORITY (team-a)='top'")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_priority_caps(tenants, env)
    # The per-tenant run cap is in every instance's settings and under its run limit (and under the
    # Helm GPU pool's, where a run in progress holds a GPU node), or one tenant could still fill them.
    for name in ("dagster.yaml", "deploy/dagster.yaml"):
        runs = yaml.safe_load((REPO / name).read_text())["concurrency"]["runs"]
        [cap] = [limit for limit in runs["tag_concurrency_limits"] if limit["key"] == TENANT_TAG]
        assert cap["value"] == {"applyLimitPerUniqueValue": True} and 1 <= cap["limit"] < runs["max_concurrent_runs"], name
    helm = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())["concurrency"]
    [cap] = [limit for limit in helm["runs"]["tagConcurrencyLimits"] if limit["key"] == TENANT_TAG]
    assert cap["value"] == {"applyLimitPerUniqueValue": True}
    assert 1 <= cap["limit"] < min(helm["runs"]["maxConcurrentRuns"], helm["pools"]["defaultLimit"])
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "serve"], capture_output=True, text=True,
                          env=serve_env({"BATCH_API_KEYS": f"team-a:{KEY_A}", "BATCH_API_MAX_PRIORITY": "high",
                                         "STORAGE_OUTPUT_PATH": str(tmp_path)}), timeout=120)
    assert proc.returncode == 2 and "BATCH_API_MAX_PRIORITY='high'" in proc.stderr, proc.stderr

"""End to end through a real `dagster dev` (web server, daemon, code server) with S3 storage.

Covers: batch_upload_sensor turned on over GraphQL, a batch file uploaded to
s3://<bucket>/incoming/ after the sensor's first tick, the daemon launching one batch_file_job run for
it (run key, its `<date>/<name>` partition, tags), real vLLM on the tiny model in that run, and the results in
s3://<bucket>/output/<date>/<name>/ checked line by line (every custom_id answered once, the bad
line in errors.jsonl with its code, batch.json completed with exact counts); later ticks start no
second run. nightly_batch_schedule fired by the scheduler daemon itself: its cron cannot change at
run time, so the test rewinds the schedule's start time in the instance to just before the last
02:00 UTC, and the daemon catches that tick up; the day before the tick holds one file, which
becomes one batch_file_job run of its partition on the warm engine (no model load). The schedule
has a `dagster dev` of its own (own instance and bucket).

The queue trigger (INPUT_QUEUE_URL) through its own `dagster dev`: the bucket notifies an SQS queue,
the sensor receives the upload's message and is held (its HEAD of the object hangs at a proxy), the
whole server is killed with SIGKILL, a new one starts on the same instance, and once the message is
visible again the file runs exactly once and the queue ends empty. It has its own bucket, queue,
proxy and instance.

The schedule's and the queue's stories run in two threads started with the module, alongside the
sensor's and `make dev`'s tests (most of their time is waiting on the scheduler's minute, ticks, the
run queue and SQS's visibility timeout); their tests report them.

S3 and SQS are moto's server (a subprocess, over HTTP); nothing is mocked. Does not test the UI
(test_ui_walkthrough.py) or the sensor's edge cases (test_sensors.py).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline_tests.support.cli_runs import jsonl_records
from batch_pipeline_tests.support import TINY_NAME, wait_for
from batch_pipeline_tests.support.dagster_server import DagsterDev, pipeline_env, start_dagster_dev
from batch_pipeline_tests.support.fault_proxy import FaultProxy
from batch_pipeline_tests.support.s3_server import _FOREIGN_AWS_VARS, MotoS3
from batch_pipeline_tests.support.sqs_queue import notifying_queue, queue_depth

SENSOR = "batch_upload_sensor"
SCHEDULE = "nightly_batch_schedule"
BATCH = "e2e-chat"
GOOD_IDS = [f"req-{i}" for i in range(1, 5)]
BAD_LINE = 3  # the line of the file that is not JSON
RUN_TIMEOUT = 240.0  # upload to batch.json: ~30 s tick wait + ~30 s run here; generous for a loaded machine


def batch_lines() -> list[str]:
    lines = [
        json.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": f"say {custom_id}"}], "max_tokens": 4},
            }
        )
        for custom_id in GOOD_IDS
    ]
    lines.insert(BAD_LINE - 1, '{"custom_id": "broken", "method": "POST", ')
    return lines


def last_nightly_tick(now: dt.datetime) -> dt.datetime:
    tick = now.replace(hour=2, minute=0, second=0, microsecond=0)
    return tick if tick <= now else tick - dt.timedelta(days=1)


def rewind_schedule_start(server: DagsterDev, name: str, start: float) -> None:
    """Make the scheduler believe the schedule has been on since `start` (it then catches up the
    missed tick). Done within the minute the schedule was started: the scheduler evaluates once a
    minute, and after its first look it remembers where it stopped."""
    from dagster._core.definitions.run_request import InstigatorType
    from dagster._core.scheduler.instigation import ScheduleInstigatorData

    instance = server.instance()
    [state] = [s for s in instance.all_instigator_state(instigator_type=InstigatorType.SCHEDULE) if s.instigator_name == name]
    data = state.instigator_data
    instance.update_instigator_state(state.with_data(ScheduleInstigatorData(cron_schedule=data.cron_schedule, start_timestamp=start)))


def s3_server_env(moto_server: MotoS3, tiny_model_dir: Path, bucket: str,
                  engine_url: str | None = None) -> dict[str, str | None]:
    env: dict[str, str | None] = {name: None for name in _FOREIGN_AWS_VARS}
    env.update(moto_server.env())
    env.update(pipeline_env(tiny_model_dir, f"s3://{bucket}/incoming", f"s3://{bucket}/output", engine_url))
    return env


@pytest.fixture(scope="module")
def e2e(moto_server: MotoS3, tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest) -> Any:
    """The sensor's and the UI's runs on the test run's warm engine (the schedule's scenario below too;
    the queue's answers in-process: both ways into the engine run end to end here)."""
    request.getfixturevalue("background")  # under way while this server comes up
    bucket = moto_server.create_bucket()
    root = tmp_path_factory.mktemp("dagster_e2e")
    server = start_dagster_dev(root / "home", s3_server_env(moto_server, tiny_model_dir, bucket, warm_engine_url),
                               root / "dagster-dev.log")
    try:
        server.start_sensor(SENSOR)
        yield server, bucket
    finally:
        print(f"dagster dev log: {server.log_path}")
        server.stop()


def test_sensor_runs_an_uploaded_batch(e2e, moto_server: MotoS3) -> None:
    server, bucket = e2e
    client = moto_server.client()

    # The first tick finds nothing and stores its cursor; the upload comes after it.
    first = wait_for("first sensor tick", lambda: [t for t in server.sensor_ticks(SENSOR) if t["status"] != "STARTED"],
                     90, on_timeout=server.log_tail)
    assert first[-1]["status"] == "SKIPPED" and not first[-1]["runIds"]
    key = f"incoming/{BATCH}.jsonl"
    client.put_object(Bucket=bucket, Key=key, Body=("\n".join(batch_lines()) + "\n").encode())
    head = client.head_object(Bucket=bucket, Key=key)
    date = head["LastModified"].astimezone(dt.timezone.utc).date().isoformat()
    uri, etag = f"s3://{bucket}/{key}", head["ETag"].strip('"')
    out = f"output/{date}/{BATCH}"

    batch = wait_for(f"s3://{bucket}/{out}/batch.json", lambda: batch_json(client, bucket, out), RUN_TIMEOUT, interval=1.0,
                     on_timeout=lambda: f"runs: {[(r.run_id, r.status) for r in runs_tagged(server, 'dagster/sensor_name', SENSOR)]}\n{server.log_tail()}")

    outputs = read_jsonl(client, bucket, f"{out}/output.jsonl")
    errors = read_jsonl(client, bucket, f"{out}/errors.jsonl")
    assert sorted(o["custom_id"] for o in outputs) == GOOD_IDS  # each answered exactly once
    for o in outputs:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
    assert [(e["error"]["code"], e["error"]["line"]) for e in errors] == [("invalid_json", BAD_LINE)]
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": len(GOOD_IDS) + 1, "completed": len(GOOD_IDS), "failed": 1}
    assert batch["input_file_id"] == uri
    assert batch["metadata"]["partition"] == date

    [run] = runs_tagged(server, "dagster/sensor_name", SENSOR)
    run = finished_run(server, run.run_id)
    assert run.status.value == "SUCCESS", server.log_tail()
    assert run.tags["dagster/run_key"] == f"{uri}@{etag}"
    assert run.job_name == "batch_file_job"
    assert run.tags["dagster/partition"] == f"{date}/{BATCH}"  # the file's own batch_files partition
    assert run.tags["batch_pipeline/input_uri"] == uri
    assert run.tags["batch_pipeline/batch_name"] == BATCH
    assert batch["metadata"]["dagster_run_id"] == run.run_id

    # The date's figures follow the file's run with no run launched for them (date_figures_sensor).
    import dagster as dg

    def date_recorded() -> Any:
        found = server.instance().fetch_materializations(
            dg.AssetRecordsFilter(dg.AssetKey("throughput_metrics"), asset_partitions=[date]), limit=1).records
        return found[0] if found else None

    record = wait_for(f"throughput_metrics of {date} recorded after the file run", date_recorded, 90,
                      on_timeout=server.log_tail)
    assert not record.run_id  # recorded by the sensor, not by a run
    figures = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert (figures["batches"], figures["requests_completed"], figures["requests_total"]) == (1, len(GOOD_IDS), 5)
    assert figures["recorded_after"] == f"{date}/{BATCH}"

    # Ticks after the one that asked for the run find nothing new: the cursor came back from the DB.
    def later_ticks() -> list[dict[str, Any]] | None:
        ticks = server.sensor_ticks(SENSOR)
        launching = [i for i, t in enumerate(ticks) if t["runIds"]]
        # A tick still being evaluated (STARTED) has no outcome yet: only finished ones count.
        finished = [t for t in ticks[: launching[0]] if t["status"] != "STARTED"] if launching else []
        return finished or None

    later = wait_for("a finished sensor tick after the run request", later_ticks, 90, interval=2.0)
    assert all(t["status"] == "SKIPPED" and not t["runIds"] for t in later), \
        [(t["status"], t["runIds"], t["error"]) for t in later]
    cursor = json.loads(later[0]["cursor"])
    assert cursor["v"] == 2 and len(cursor["seen"]) == 1
    assert len(runs_tagged(server, "dagster/sensor_name", SENSOR)) == 1


def engine_cli(env: dict[str, str], *args: str) -> Any:
    """`batch-pipeline engine <args>` in a process of its own; its CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "batch_pipeline.cli", "engine", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_make_dev_starts_without_warnings(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`make dev` (the README's UI command) starts a warm engine, then comes up with the code location
    loaded and the daemons healthy, its runs pointed at the engine, and prints no warning on the way
    (Dagster's or Python's); Ctrl-C stops the engine too.

    The engine is `batch-pipeline engine start`'s (the suite's one real start through the CLI; its flags
    are engine/test_engine_server.py's): `engine status` shows it up, it computes on every core, answers
    a chat with a priority with cached-token details in its usage, a second start on its port is refused, and after
    Ctrl-C `engine stop` has stopped it and `engine status` no longer lists it."""
    import os
    import re
    import signal
    import subprocess

    from batch_pipeline_tests.support.dagster_server import DagsterDev, free_port
    from batch_pipeline_tests.support import REPO
    from batch_pipeline_tests.support.signals import as_from_a_terminal

    import urllib.request

    import psutil

    from batch_pipeline.engine.server import read_record

    home, port, log_path, engine_port = tmp_path / "home", free_port(), tmp_path / "make-dev.log", free_port()
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_AWS_VARS}
    env.update({k: v for k, v in pipeline_env(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out")).items()
                if v is not None})
    env["DAGSTER_HOME"] = str(home)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(["make", "--no-print-directory", "dev", f"DEV_PORT={port}", f"ENGINE_PORT={engine_port}"],
                                   cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=as_from_a_terminal)  # Ctrl-C reaches it
    server = DagsterDev(process=process, home=home, port=port, log_path=log_path)
    try:
        # The engine first (~30 s for the tiny model here), then dagster dev.
        wait_for("make dev ready (location loaded, daemons healthy)", server._ready, 360, on_timeout=server.log_tail)
        engine_url = f"http://127.0.0.1:{engine_port}"
        assert urllib.request.urlopen(f"{engine_url}/health", timeout=5).status == 200
        [code_server, *_] = [p for p in psutil.Process(process.pid).children(recursive=True)
                             if "code-server" in " ".join(p.cmdline())]
        assert code_server.environ().get("ENGINE_URL") == engine_url  # the runs it launches answer on the engine

        shown = engine_cli(env, "status")  # its exit code also counts engines others left recorded down: not asserted
        assert f"{engine_url}  up" in shown.stdout and TINY_NAME in shown.stdout, shown
        record = read_record(engine_port)
        engine_env = dict(item.split("=", 1) for item in Path(f"/proc/{record.pid}/environ").read_text().split("\0")
                          if "=" in item)
        # one rank: it computes on every core (vLLM's CPU build would keep one for its scheduler)
        assert engine_env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
        body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "priority": 5}
        request = urllib.request.Request(f"{engine_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["prompt_tokens_details"] is not None  # --enable-prompt-tokens-details
        again = engine_cli(env, "start", "--port", str(engine_port))
        assert again.returncode != 0 and f"an engine already runs on port {engine_port}" in again.stderr, again
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            process.wait(timeout=90)  # make's trap stops the engine after dagster dev: on loaded cores, over 30 s seen
        except subprocess.TimeoutExpired:
            server.stop()
        left = read_record(engine_port)
        if left is not None:  # make killed before its trap ran: the engine (a session of its own) is stopped here
            engine_cli(env, "stop", "--port", str(engine_port))
    text = log_path.read_text(errors="replace")
    assert "Serving dagster-webserver" in text, text[-2000:]
    warnings = [line for line in text.splitlines() if re.search(r" - WARNING - |\w+Warning: ", re.sub(r"\x1b\[[0-9;]*m", "", line))]
    assert not warnings, "\n".join(warnings)
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()
    # No "Join the Dagster community" dialog over the first page a user opens (issue #28).
    assert (home / ".nux" / "nux.yaml").read_text() == "seen: 1\n"
    assert f"engine up on http://127.0.0.1:{engine_port}" in text, text[-2000:]
    assert left is None  # stopped with dev: no engine left behind
    assert f"stopped the engine on {engine_url}" in text, text[-2000:]  # make's trap: `engine stop`
    assert engine_url not in engine_cli(env, "status").stdout
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{engine_url}/health", timeout=2)


def runs_tagged(server: DagsterDev, key: str, value: str) -> list[Any]:
    import dagster as dg

    return list(server.instance().get_runs(filters=dg.RunsFilter(tags={key: value})))


def finished_run(server: DagsterDev, run_id: str, timeout: float = 120.0) -> Any:
    def done() -> Any:
        run = server.instance().get_run_by_id(run_id)
        return run if run.is_finished else None

    return wait_for(f"run {run_id} finished", done, timeout, on_timeout=server.log_tail)


def materialization_metadata(server: DagsterDev, run_id: str, asset: str) -> dict[str, Any]:
    import dagster as dg

    for entry in server.instance().all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION):
        materialization = entry.dagster_event.event_specific_data.materialization
        if materialization.asset_key.to_user_string() == asset:
            return {k: v.value for k, v in materialization.metadata.items()}
    raise AssertionError(f"no materialization of {asset} in run {run_id}")


def read_jsonl(client: Any, bucket: str, key: str) -> list[dict[str, Any]]:
    text = client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    return jsonl_records(text)


def batch_json(client: Any, bucket: str, folder: str) -> dict[str, Any] | None:
    """The Batch object in s3://bucket/folder/, once written."""
    try:
        return json.loads(client.get_object(Bucket=bucket, Key=f"{folder}/batch.json")["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


# Tests whose work runs in background threads started with the module (by `e2e`, or by the first of
# them to run), a thread each: most of the schedule's time is waiting for the scheduler's next minute,
# most of the queue scenario's for sensor ticks, the run queue and SQS's visibility timeout; the
# sensor's and `make dev`'s tests fill that time. (In turn in one thread, the queue's test waited
# 50 s for the schedule's scenario to end first, with a core free.)
BACKGROUND = {
    "test_schedule_fired_by_the_daemon_runs_each_file_of_yesterday": "schedule",
    "test_queue_trigger_survives_a_server_killed_between_receive_and_run_request": "queue",
}


@pytest.fixture(scope="module")
def background(request: pytest.FixtureRequest, moto_server: MotoS3, tiny_model_dir: Path, warm_engine_url: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """The selected ones of BACKGROUND's scenarios, each in a thread of its own (their buckets, queues
    and `dagster dev`s are their own): name -> its future."""
    selected = {BACKGROUND[item.name] for item in request.session.items
                if item.name in BACKGROUND and item.path == request.path}
    with ThreadPoolExecutor(len(BACKGROUND), thread_name_prefix="e2e-background") as pool:
        futures = {}
        if "schedule" in selected:
            futures["schedule"] = pool.submit(schedule_scenario, moto_server, tiny_model_dir,
                                              tmp_path_factory.mktemp("schedule"), warm_engine_url)
        if "queue" in selected:
            futures["queue"] = pool.submit(queue_trigger_scenario, moto_server, tiny_model_dir,
                                           tmp_path_factory.mktemp("queue_trigger"))
        yield futures
        # Leaving the block waits for them (each scenario's own `finally` stops its servers).


def schedule_scenario(moto_server: MotoS3, tiny_model_dir: Path, tmp_path: Path, engine_url: str) -> None:
    """nightly_batch_schedule fired by the scheduler daemon of its own `dagster dev` (own instance and
    bucket), on the test run's warm engine: yesterday's one file becomes one named file run, whose
    partition the tick added; raises what fails."""
    bucket = moto_server.create_bucket()
    client = moto_server.client()
    server = start_dagster_dev(tmp_path / "home", s3_server_env(moto_server, tiny_model_dir, bucket, engine_url),
                               tmp_path / "dagster-dev.log")
    try:
        # Start the schedule and rewind it inside one scheduler minute (see rewind_schedule_start).
        if time.time() % 60 > 45:
            time.sleep(61 - time.time() % 60)  # time that must pass: to the next minute
        tick = last_nightly_tick(dt.datetime.now(dt.timezone.utc))
        partition = (tick - dt.timedelta(days=1)).date().isoformat()
        client.put_object(Bucket=bucket, Key=f"incoming/{partition}/{BATCH}.jsonl",
                          Body=("\n".join(batch_lines()) + "\n").encode())
        server.start_schedule(SCHEDULE)
        rewind_schedule_start(server, SCHEDULE, tick.timestamp() - 60)

        [run] = wait_for("a run launched by nightly_batch_schedule",
                         lambda: runs_tagged(server, "dagster/schedule_name", SCHEDULE), 150, interval=1.0,
                         on_timeout=server.log_tail)
        run = finished_run(server, run.run_id, timeout=RUN_TIMEOUT)
        assert run.status.value == "SUCCESS", server.log_tail()
        assert run.job_name == "batch_file_job"
        assert run.tags["dagster/partition"] == f"{partition}/{BATCH}"
        assert run.tags["dagster/run_key"].startswith(f"nightly-{partition}/{BATCH}@")
        assert run.tags["batch_pipeline/engine"] == engine_url
        answered = read_jsonl(client, bucket, f"output/{partition}/{BATCH}/output.jsonl")
        assert sorted(o["custom_id"] for o in answered) == GOOD_IDS
        file = materialization_metadata(server, run.run_id, "batch_files")
        assert file["status"] == "completed" and file["model_load_seconds"] == 0  # a warm engine loads nothing
    finally:
        print(f"dagster dev log: {server.log_path}")
        server.stop()


def test_schedule_fired_by_the_daemon_runs_each_file_of_yesterday(background: dict[str, Future]) -> None:
    """See schedule_scenario (it ran alongside the tests above; this raises what it raised)."""
    background["schedule"].result()


def test_queue_trigger_survives_a_server_killed_between_receive_and_run_request(background: dict[str, Future]) -> None:
    """Received, held, server killed, message back, run exactly once, queue empty: see
    queue_trigger_scenario (it ran alongside the tests above; this raises what it raised)."""
    background["queue"].result()


def queue_trigger_scenario(moto_server: MotoS3, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The queue trigger's whole story (test_queue_trigger_survives_a_server_killed_between_receive_and_run_request),
    on its own bucket, queue, proxy and `dagster dev`s; raises what fails."""
    fault_proxy = FaultProxy(moto_server.endpoint_url).start()
    try:
        _queue_trigger_scenario(moto_server, tiny_model_dir, tmp_path, fault_proxy)
    finally:
        fault_proxy.stop()


def _queue_trigger_scenario(moto_server: MotoS3, tiny_model_dir: Path, tmp_path: Path, fault_proxy: FaultProxy) -> None:
    bucket = moto_server.create_bucket()
    client = moto_server.client()
    url = notifying_queue(moto_server, bucket)
    env: dict[str, str | None] = {name: None for name in _FOREIGN_AWS_VARS}
    env.update(moto_server.env())
    env["AWS_ENDPOINT_URL"] = fault_proxy.endpoint_url  # the server's S3 and SQS calls pass the proxy
    env.update(pipeline_env(tiny_model_dir, f"s3://{bucket}/incoming", f"s3://{bucket}/output",
                            INPUT_QUEUE_URL=url, INPUT_QUEUE_VISIBILITY_SECONDS="20"))
    home = tmp_path / "home"
    server = start_dagster_dev(home, env, tmp_path / "dagster-dev-1.log")
    try:
        server.start_sensor(SENSOR)
        wait_for("first sensor tick", lambda: [t for t in server.sensor_ticks(SENSOR) if t["status"] != "STARTED"],
                 90, on_timeout=server.log_tail)
        # The next tick receives the upload's message, then hangs on the HEAD of the object.
        key = f"incoming/{BATCH}-queued.jsonl"
        fault_proxy.fail_next(1, "timeout", method="HEAD", match=key, hold=300)
        client.put_object(Bucket=bucket, Key=key, Body=("\n".join(batch_lines()) + "\n").encode())
        wait_for("the sensor holding the message", lambda: fault_proxy.injected("timeout", "HEAD") or None, 90,
                 on_timeout=server.log_tail)
        assert queue_depth(moto_server, url) == (0, 1)
        server.kill()
    except BaseException:
        server.stop()
        raise
    assert queue_depth(moto_server, url) == (0, 1)  # in flight: received, never deleted
    assert not runs_tagged(server, "dagster/sensor_name", SENSOR)

    server = start_dagster_dev(home, env, tmp_path / "dagster-dev-2.log")
    try:
        head = client.head_object(Bucket=bucket, Key=key)
        date = head["LastModified"].astimezone(dt.timezone.utc).date().isoformat()
        out = f"output/{date}/{BATCH}-queued"

        batch = wait_for(f"s3://{bucket}/{out}/batch.json", lambda: batch_json(client, bucket, out), RUN_TIMEOUT,
                         interval=1.0, on_timeout=server.log_tail)
        assert batch["status"] == "completed"
        assert sorted(o["custom_id"] for o in read_jsonl(client, bucket, f"{out}/output.jsonl")) == GOOD_IDS
        [run] = runs_tagged(server, "dagster/sensor_name", SENSOR)
        assert run.tags["dagster/run_key"] == f"s3://{bucket}/{key}@{head['ETag'].strip(chr(34))}"
        assert finished_run(server, run.run_id).status.value == "SUCCESS"
        # The tick after the one that asked for the run deletes the message.
        wait_for("an empty queue", lambda: queue_depth(moto_server, url) == (0, 0) or None, 120, interval=1.0)
        assert len(runs_tagged(server, "dagster/sensor_name", SENSOR)) == 1
    finally:
        print(f"dagster dev logs: {tmp_path}")
        server.stop()

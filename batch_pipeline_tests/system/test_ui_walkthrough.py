"""The Dagster UI in a real browser, as a new user walks through it: backfill, each file, re-run, sensor, figures.

Covers: Debian's Chromium driven by Playwright against a real `dagster dev` (local folders for
storage, the tiny model on the test run's warm engine). One date holds three files, one of them
broken (every line invalid). In order, sharing one server:
0. the first page a user opens: no "Join the Dagster community" dialog over it (the instance has
   `.nux/nux.yaml`, as `make dev` writes it).
1. the three files are batch_files partitions before any run (file_partitions_sensor, on by
   default); from Jobs > batch_file_job, "Materialize…", "Missing" (the three), "Launch backfill": the daemon runs them as three runs of batch_file_job, side by side on the warm engine
   (no gpu pool slot); two succeed and the broken file's run fails (the backfill, recorded failed,
   lists the three runs).
2. the broken file's partition is red (FAILED) natively, the others green; its page names the failed
   run, and the run's page gives the reason: the failure's description and metadata (error codes,
   first error lines, errors.jsonl). The date's batch_outputs and throughput_metrics are recorded by
   date_figures_sensor after the runs, with no run of their own; the failed_line_rate check reads
   the same in the check list, on the lineage node and in its pane.
3. the broken file, fixed, is re-run alone from its partition (no config typed): it turns green, and
   the date's figures follow on their own (a new runless materialization with the fixed file's lines),
   no run launched beside the re-run.
4. the upload sensor turned on afterwards starts no run for the finished files, and the date's
   throughput figures add up its files.
5. a new upload: the sensor runs it as its own batch_file_job run, and the file's page names that
   job (and its run).
Screenshots of each step go to UI_SCREENSHOTS_DIR (default: the test's tmp folder; docs/UI.md's
pictures in docs/ui/ come from `UI_SCREENSHOTS_DIR=docs/ui`).

Needs /usr/bin/chromium and the `playwright` package; if either is missing the test runs
scripts/install_browser.sh once and skips, saying so, only if that cannot install them. Playwright
never downloads a browser of its own. Does not cover S3 or the SQS queue (test_dagster_e2e.py,
test_sensor_queue.py).
"""

from __future__ import annotations

import datetime as dt
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.defs.partitions import batch_file_partitions
from batch_pipeline_tests.support import REPO, TINY_NAME, wait_for
from batch_pipeline_tests.support.dagster_server import DagsterDev, pipeline_env, start_dagster_dev

CHROMIUM = Path("/usr/bin/chromium")
# Keep the browser off the network (these flags stop its background fetches).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
BACKFILL_TIMEOUT = 300.0  # two runs, each ~25 s of imports and engine start, sharing one gpu slot
UI_TIMEOUT_MS = 60_000


def ensure_browser() -> Any:
    """The playwright module, with Chromium installed; skip only if neither can be installed."""
    def ready() -> bool:
        return CHROMIUM.exists() and importlib.util.find_spec("playwright") is not None

    if not ready():
        script = REPO / "scripts" / "install_browser.sh"
        result = subprocess.run(["bash", str(script), str(Path(sys.executable).parent.parent)],
                                capture_output=True, text=True, timeout=900)
        importlib.invalidate_caches()
        if not ready():
            pytest.skip(f"no browser for the UI test: {CHROMIUM} or playwright missing and "
                        f"{script} could not install them: {(result.stderr or result.stdout)[-500:]}")
    return importlib.import_module("playwright.sync_api")


def chat_line(custom_id: str) -> str:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"hello {custom_id}"}], "max_tokens": 3}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


FILES = ("alpha", "beta", "broken")


@pytest.fixture(scope="module")
def ui(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    playwright = ensure_browser()
    root = tmp_path_factory.mktemp("dagster_ui")
    inbox, out = root / "in", root / "out"
    # Yesterday: inside the upload sensor's window (SENSOR_WINDOW_DAYS, 3), which file_partitions_sensor
    # lists too; the only partition (PARTITIONS_START), so the dialogs list little.
    date = (dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=1)).isoformat()
    (inbox / date).mkdir(parents=True)
    for name in FILES[:2]:
        (inbox / date / f"{name}.jsonl").write_text("\n".join(chat_line(f"{name}-{i}") for i in range(3)) + "\n")
    (inbox / date / "broken.jsonl").write_text('{"custom_id": "b-1"}\nnot json\n')  # every line invalid
    env = pipeline_env(tiny_model_dir, str(inbox), str(out), warm_engine_url, PARTITIONS_START=date)
    shots = Path(os.environ.get("UI_SCREENSHOTS_DIR") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    server = start_dagster_dev(root / "home", env, root / "dagster-dev.log")
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield Walk(server, page, date, inbox, out, shots)
            browser.close()
    finally:
        print(f"dagster dev log: {server.log_path}; screenshots: {shots}")
        server.stop()


class Walk:
    """What the steps of the walk-through share: the server, the page, the date, the folders."""

    def __init__(self, server: DagsterDev, page: Any, date: str, inbox: Path, out: Path, shots: Path):
        self.server, self.page, self.date, self.inbox, self.out, self.shots = server, page, date, inbox, out, shots
        self.backfill_id = ""  # step 1's backfill and its three runs
        self.runs: dict[str, Any] = {}  # file name -> its backfill run

    def key(self, name: str) -> str:
        return f"{self.date}/{name}"

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"))

    def file_status(self) -> dict[str, str]:
        instance = self.server.instance()
        keys = instance.get_dynamic_partitions(batch_file_partitions.name)
        found = instance.get_status_by_partition(dg.AssetKey("batch_files"), keys, batch_file_partitions) or {}
        return {k: (v.value if v else "MISSING") for k, v in found.items()}

    def figures(self) -> tuple[int, str | None, dict[str, Any]]:
        """(storage id, run id, metadata) of throughput_metrics' latest materialization for the date."""
        records = self.server.instance().fetch_materializations(
            dg.AssetRecordsFilter(dg.AssetKey("throughput_metrics"), asset_partitions=[self.date]), limit=1).records
        assert records, f"no throughput_metrics for {self.date}"
        record = records[0]
        return record.storage_id, record.run_id, {k: v.value for k, v in record.asset_materialization.metadata.items()}

    def figures_after(self, storage_id: int) -> tuple[int, str | None, dict[str, Any]]:
        """The date's figures once recorded after `storage_id` (by date_figures_sensor, every 15 s)."""
        def newer() -> Any:
            records = self.server.instance().fetch_materializations(
                dg.AssetRecordsFilter(dg.AssetKey("throughput_metrics"), asset_partitions=[self.date],
                                      after_storage_id=storage_id or None), limit=1).records
            return self.figures() if records else None

        return wait_for(f"throughput_metrics of {self.date} recorded", newer, 120, interval=1.0,
                        on_timeout=self.server.log_tail)


def visible(page: Any, text: str) -> Any:
    """The first visible element with `text` (the UI also renders hidden copies to measure them)."""
    return page.locator(f"text={text} >> visible=true").first


def open_group(server: DagsterDev, page: Any) -> None:
    """The batch group's lineage (the date's assets, and the failed_line_rate check on batch_outputs)."""
    page.goto(f"{server.url}/locations/batch_pipeline/asset-groups/batch")
    for asset in ("validated_requests", "inference_results", "batch_outputs", "throughput_metrics"):
        page.get_by_text(asset, exact=True).first.wait_for()


COMMUNITY_DIALOG = "Join the Dagster community"
NUX_DELAY_MS = 1500  # the UI opens the dialog 1 s after the server says to (setTimeout 1e3 in its bundle)


def body_with(page: Any, *texts: str, timeout: float = 30.0) -> str:
    """The page's text once it holds every one of `texts` (or after `timeout` seconds, as it is then:
    the caller's assertions say what is missing)."""
    deadline = time.monotonic() + timeout
    while True:
        body = page.inner_text("body")
        if all(text in body for text in texts) or time.monotonic() > deadline:
            return body
        page.wait_for_timeout(250)


def test_first_visit_opens_on_the_work_without_the_community_dialog(ui: Walk) -> None:
    server, page = ui.server, ui.page
    assert server.graphql("{ shouldShowNux }")["shouldShowNux"] is False
    # The UI asks the server whether to show the dialog (ShouldShowNux) and, told yes, opens it a
    # second later (a timer in Dagster's UI): the answer, then that second and a half more.
    with page.expect_response(lambda r: "/graphql" in r.url and "ShouldShowNux" in (r.request.post_data or r.url)):
        page.goto(server.url)
    page.get_by_text("Overview", exact=True).first.wait_for()
    page.wait_for_timeout(NUX_DELAY_MS)
    ui.shot("0-first-visit")
    assert page.get_by_text(COMMUNITY_DIALOG).count() == 0
    assert page.get_by_role("dialog").count() == 0


def test_backfill_of_a_dates_files_from_the_job_page(ui: Walk) -> None:
    server, page = ui.server, ui.page
    keys = [ui.key(name) for name in FILES]
    # Each file is a partition before any run has seen it (file_partitions_sensor, on by default).
    wait_for("the files' batch_files partitions", lambda: set(keys) <= set(
        server.instance().get_dynamic_partitions(batch_file_partitions.name)) or None, 120, interval=1.0,
        on_timeout=server.log_tail)
    page.goto(f"{server.url}/locations/batch_pipeline/jobs/batch_file_job")
    page.get_by_text("batch_files", exact=True).first.wait_for()
    ui.shot("1-batch-file-job")
    page.get_by_role("button", name="Materialize…").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Missing", exact=True).click()  # the files no run has answered: the date's three
    dialog.get_by_text("3 partitions", exact=True).wait_for()
    listed = dialog.inner_text()
    assert all(key in listed for key in keys), listed[:2000]
    ui.shot("2-three-files")
    dialog.get_by_role("button", name="Launch backfill").click()
    dialog.wait_for(state="detached")

    instance = server.instance()
    [backfill] = wait_for("the backfill in the instance", instance.get_backfills, 30, interval=0.5)
    ui.backfill_id = backfill.backfill_id

    def runs_finished() -> Any:
        found = backfill_runs(server, backfill.backfill_id)
        return found if len(found) == 3 and all(r.is_finished for r in found) else None

    runs = wait_for(f"backfill {backfill.backfill_id}'s three runs finished", runs_finished, BACKFILL_TIMEOUT,
                    interval=0.5, on_timeout=server.log_tail)
    ui.runs = {r.tags["dagster/partition"].split("/", 1)[1]: r for r in runs}
    assert sorted(ui.runs) == sorted(FILES)  # one run per file
    assert {n: r.status.value for n, r in ui.runs.items()} == {"alpha": "SUCCESS", "beta": "SUCCESS", "broken": "FAILURE"}
    assert {r.job_name for r in runs} == {"batch_file_job"}  # named: launched from the job's page
    for name in FILES[:2]:
        batch = json.loads((ui.out / ui.date / name / "batch.json").read_text())
        assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert json.loads((ui.out / ui.date / "broken" / "batch.json").read_text())["status"] == "failed"
    # On the warm engine no run waited for the gpu pool; their steps may overlap on the server.
    waited = [r.run_id for r in runs if any("blocked by limit for pool gpu" in (e.message or "")
                                             for e in server.instance().all_logs(r.run_id))]
    spans = sorted(step_span(server, r.run_id, "batch_files") for r in runs if r.status.value == "SUCCESS")
    print(f"batch_files spans {spans}; runs that waited for the gpu pool: {waited}")
    assert waited == []


def new_run_finished(server: DagsterDev, before: set[str]) -> Any:
    """The newest run whose id is not in `before`, once it has finished (None until then)."""
    new = [r for r in server.instance().get_runs() if r.run_id not in before]
    return new[0] if new and new[0].is_finished else None


def backfill_runs(server: DagsterDev, backfill_id: str) -> list[Any]:
    return list(server.instance().get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})))


def test_the_broken_file_is_red_with_its_reason_and_the_date_follows(ui: Walk) -> None:
    server, page = ui.server, ui.page
    assert ui.file_status() == {ui.key("alpha"): "MATERIALIZED", ui.key("beta"): "MATERIALIZED",
                                ui.key("broken"): "FAILED"}  # red, natively: its run failed
    failed = ui.runs["broken"]
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={ui.key('broken')}")
    visible(page, ui.key("alpha")).wait_for()
    body = body_with(page, "Failed", failed.run_id[:8])
    ui.shot("3-broken-file-red")
    assert failed.run_id[:8] in body, body[:3000]  # the partition names the run that failed it

    # The run's page: the reason, as the failure's description and metadata.
    page.goto(f"{server.url}/runs/{failed.run_id}")
    expected = ("broken of", "no_valid_lines", "first_error_lines", "errors.jsonl")
    body = body_with(page, *expected, timeout=60)
    ui.shot("4-failed-run-reason")
    for text in expected:
        assert text in body, (text, body[:3000])
    page.goto(f"{server.url}/runs/b/{ui.backfill_id}?tab=runs")
    visible(page, "Failure").wait_for()
    visible(page, "Success").wait_for()
    ui.shot("5-backfill")

    # The date's results and figures, recorded after its file runs with no run of their own.
    storage_id, run_id, figures = ui.figures_after(0)
    if figures["requests_total"] != 8:  # recorded before the last file run ended: the next record
        storage_id, run_id, figures = ui.figures_after(storage_id)
    assert run_id in (None, "")
    assert (figures["batches"], figures["requests_completed"], figures["requests_total"]) == (3, 6, 8)
    outputs = server.instance().fetch_materializations(
        dg.AssetRecordsFilter(dg.AssetKey("batch_outputs"), asset_partitions=[ui.date]), limit=1).records[0]
    counts = {k: v.value for k, v in outputs.asset_materialization.metadata.items()}
    assert (counts["completed"], counts["failed"], counts["total"]) == (6, 2, 8)
    page.goto(f"{server.url}/assets/throughput_metrics?view=partitions&partition={ui.date}")
    body = body_with(page, "recorded_after", "date_figures_sensor")
    ui.shot("6-date-figures-recorded")
    assert "failed, and did not materialize this asset" not in body  # no date run failed: no banner


def test_the_check_reads_the_same_in_the_list_on_the_node_and_in_its_pane(ui: Walk) -> None:
    """The check's latest execution is what the list, the pane and the lineage node show (the node
    counts one check, not one per date)."""
    server, page = ui.server, ui.page
    key = dg.AssetCheckKey(dg.AssetKey("batch_outputs"), "failed_line_rate")
    [latest] = wait_for("a failed_line_rate execution", lambda: server.instance().event_log_storage.get_asset_check_execution_history(
        key, limit=1) or None, 120, interval=1.0)
    print("latest failed_line_rate execution:", latest.status, latest.run_id)
    page.goto(f"{server.url}/assets/batch_outputs?view=checks")
    visible(page, "failed_line_rate").wait_for()
    word = {"SUCCEEDED": "Succeeded", "FAILED": "Failed"}.get(latest.status.value, "Execution failed")
    body = body_with(page, word)
    ui.shot("7-check-list-and-pane")
    print("check page:", body[:3000])
    assert word in body, body[:3000]
    open_group(server, page)
    # The node counts the check's latest execution: "1 / 1 Passed" or "0 / 1 Passed" (one check).
    passed = "1 / 1 Passed" if latest.status.value == "SUCCEEDED" else "0 / 1 Passed"
    node = body_with(page, passed)
    ui.shot("8-check-on-the-lineage-node")
    assert passed in node, node[:3000]


def test_the_broken_file_fixed_reruns_alone_and_the_date_follows(ui: Walk) -> None:
    server, page = ui.server, ui.page
    key = ui.key("broken")
    storage_id, _, _ = ui.figures()
    (ui.inbox / ui.date / "broken.jsonl").write_text("\n".join(chat_line(f"fixed-{i}") for i in range(2)) + "\n")
    before = {r.run_id for r in server.instance().get_runs()}
    page.goto(f"{server.url}/assets/batch_files?view=partitions")
    visible(page, key).click()  # the red one
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Launch runs to materialize batch_files").wait_for()
    dialog.get_by_text("1 partition", exact=True).wait_for()  # the selected file, preselected
    ui.shot("9-rerun-one-file")
    dialog.get_by_role("button", name="Launch 1 run").click()
    dialog.wait_for(state="detached")
    check_backfill_done(ui)  # while the re-run comes up

    run = wait_for("the re-run of the broken file", lambda: new_run_finished(server, before), BACKFILL_TIMEOUT,
                   interval=0.5, on_timeout=server.log_tail)
    assert run.status.value == "SUCCESS", server.log_tail()
    assert run.tags["dagster/partition"] == key  # that file alone
    fixed = json.loads((ui.out / ui.date / "broken" / "batch.json").read_text())
    assert fixed["status"] == "completed" and fixed["request_counts"]["completed"] == 2
    assert ui.file_status()[key] == "MATERIALIZED"
    # The date follows with no other launch: its figures recorded again, by no run. A record between
    # (the sensor saw the fixed file land in the inbox, or ticked while the re-run was under way) may
    # still count the old answers: the test waits for the one that counts the re-run's.
    def followed() -> Any:
        latest = ui.figures()
        return latest if latest[0] > storage_id and latest[2]["requests_completed"] == 8 else None

    _, run_id, figures = wait_for(f"throughput_metrics of {ui.date} counting the re-run's answers", followed, 120,
                                  interval=1.0, on_timeout=lambda: f"latest: {ui.figures()}\n{server.log_tail()}")
    assert run_id in (None, "") and figures["requests_total"] == 8
    assert [r.run_id for r in server.instance().get_runs() if r.run_id not in before] == [run.run_id]
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={key}")
    visible(page, "results").wait_for()  # the file's metadata: status, counts, where its results are
    visible(page, "date_assets").wait_for()  # what happens to its date
    body = body_with(page, run.run_id[:8])
    ui.shot("10-batch-files-after-rerun")
    assert run.run_id[:8] in body
    page.goto(f"{server.url}/assets/throughput_metrics?view=partitions&partition={ui.date}")
    visible(page, "recorded_after").wait_for()
    ui.shot("11-date-figures-after-rerun")


def check_backfill_done(ui: Walk) -> None:
    """Step 1's backfill, as the daemon records it once its runs are over: failed (one file failed),
    with no run but those three."""
    server = ui.server

    def finished() -> Any:
        current = server.instance().get_backfill(ui.backfill_id)
        return current if current.status.value not in ("REQUESTED", "CANCELING") else None

    done = wait_for(f"backfill {ui.backfill_id} finished", finished, BACKFILL_TIMEOUT, interval=0.5,
                    on_timeout=server.log_tail)
    assert done.status.value == "COMPLETED_FAILED", server.log_tail()
    assert sorted(r.run_id for r in backfill_runs(server, ui.backfill_id)) == sorted(r.run_id for r in ui.runs.values())


def test_sensor_on_afterwards_starts_nothing_and_figures_add_up(ui: Walk) -> None:
    server, page = ui.server, ui.page
    figures_before = ui.figures()
    runs_before = len(server.instance().get_runs())
    server.start_sensor("batch_upload_sensor")
    tick = wait_for("a finished sensor tick", lambda: next(
        (t for t in server.sensor_ticks("batch_upload_sensor") if t["status"] in ("SKIPPED", "SUCCESS", "FAILURE")), None),
        120, interval=1.0, on_timeout=server.log_tail)
    assert tick["status"] == "SKIPPED", tick  # every file there is completed: no run
    assert len(server.instance().get_runs()) == runs_before
    assert ui.figures() == figures_before  # not touched
    per_file = [json.loads(m.read_text()) for m in sorted((ui.out / ui.date).glob("*/metrics.json"))]
    _, _, totals = figures_before
    assert totals["batches"] == len(per_file) == 3
    for key in ("requests_completed", "requests_total", "output_tokens"):
        assert totals[key] == sum(m[key] for m in per_file), key
    open_group(server, page)
    ui.shot("12-asset-group-after")


def test_a_new_upload_runs_as_its_own_named_run(ui: Walk) -> None:
    server, page = ui.server, ui.page
    before = {r.run_id for r in server.instance().get_runs()}
    (ui.inbox / ui.date / "late.jsonl").write_text("\n".join(chat_line(f"late-{i}") for i in range(2)) + "\n")

    run = wait_for("the sensor's run of the new upload", lambda: new_run_finished(server, before), BACKFILL_TIMEOUT,
                   interval=0.5, on_timeout=server.log_tail)
    assert run.status.value == "SUCCESS", server.log_tail()
    key = ui.key("late")
    assert (run.job_name, run.tags["dagster/partition"]) == ("batch_file_job", key)
    assert run.tags["batch_pipeline/engine"].startswith("http://")  # the warm engine the runs answer on
    assert ui.file_status()[key] == "MATERIALIZED"
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={key}")
    body = body_with(page, run.run_id[:8], "batch_file_job")
    ui.shot("13-new-upload-named-job")
    assert re.search(r"Job\s+batch_file_job", body), body[:3000]  # the sensor's job, on the file's page
    assert run.run_id[:8] in body


def step_span(server: DagsterDev, run_id: str, step: str) -> tuple[float, float]:
    records = server.instance().all_logs(run_id)
    starts = [r.timestamp for r in records if r.step_key == step and r.dagster_event
              and r.dagster_event.event_type == dg.DagsterEventType.STEP_START]
    ends = [r.timestamp for r in records if r.step_key == step and r.dagster_event
            and r.dagster_event.event_type == dg.DagsterEventType.STEP_SUCCESS]
    assert starts and ends, f"no {step} start/success in run {run_id}"
    return starts[0], ends[-1]

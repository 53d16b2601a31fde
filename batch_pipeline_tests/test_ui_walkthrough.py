"""The Dagster UI in a real browser, as a new user walks through it: backfill, each file, re-run, sensor, figures.

Covers: Debian's Chromium driven by Playwright against a real `dagster dev` (local folders for
storage, the tiny model). In order, sharing one server:
0. the first page a user opens: no "Join the Dagster community" dialog over it (the instance has
   `.nux/nux.yaml`, as `make dev` writes it).
1. the asset group page; "Materialize all…", a typed range of two dates, "Launch backfill"; the
   backfill daemon runs both dates (two runs sharing the `gpu` pool, limit 1: they queue for it and
   do not fail). The second date holds a broken file (every line invalid): its run fails, and the
   daemon records the backfill failed (checked, with its page, while step 3's re-run comes up).
2. the batch_files asset shows each file of those dates: the others green; the broken one is not
   green, and its page leads in one click ("View all historical events (1)") to why: status failed,
   the reason, error codes, first error lines, errors.jsonl, the run and the job that failed it
   (the Events tab shows the same). The failed_line_rate check reads the same in the check list, on
   the lineage node and in its pane.
3. the broken file, fixed, is re-run alone from its partition (no config typed): the file turns
   green with its model_load_seconds and the run named; the date's pages still tell the failed
   run's story, and only it (the failure banner over no materialization), and the file's page says
   how to record the date. The date materialized from Jobs > batch_job then takes nothing, loads no
   model, and records the date: batch_outputs green, throughput_metrics without the failure banner,
   the job named batch_job on its page.
4. the upload sensor turned on afterwards starts no run for the finished files, and the dates'
   throughput figures do not change; they add up the files of each date.
5. a new upload: the sensor runs it as batch_job, and the file's page names that job (and its run).
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
from batch_pipeline_tests.conftest import REPO, TINY_NAME
from batch_pipeline_tests.dagster_server import DagsterDev, pipeline_env, start_dagster_dev, wait_for

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


@pytest.fixture(scope="module")
def ui(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    playwright = ensure_browser()
    root = tmp_path_factory.mktemp("dagster_ui")
    inbox, out = root / "in", root / "out"
    # Two recent dates: the dialog lists the last 90 days by default.
    today = dt.datetime.now(dt.timezone.utc).date()
    # Inside the upload sensor's window (SENSOR_WINDOW_DAYS, 3): it sees these files when turned on.
    dates = [(today - dt.timedelta(days=d)).isoformat() for d in (2, 1)]
    for date in dates:
        (inbox / date).mkdir(parents=True)
        (inbox / date / f"ui-{date}.jsonl").write_text("\n".join(chat_line(f"{date}-{i}") for i in range(3)) + "\n")
    (inbox / dates[1] / "broken.jsonl").write_text('{"custom_id": "b-1"}\nnot json\n')  # every line invalid
    env = pipeline_env(tiny_model_dir, str(inbox), str(out), warm_engine_url, PARTITIONS_START=dates[0])
    shots = Path(os.environ.get("UI_SCREENSHOTS_DIR") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    server = start_dagster_dev(root / "home", env, root / "dagster-dev.log")
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield Walk(server, page, dates, inbox, out, shots)
            browser.close()
    finally:
        print(f"dagster dev log: {server.log_path}; screenshots: {shots}")
        server.stop()


class Walk:
    """What the steps of the walk-through share: the server, the page, the two dates, the folders."""

    def __init__(self, server: DagsterDev, page: Any, dates: list[str], inbox: Path, out: Path, shots: Path):
        self.server, self.page, self.dates, self.inbox, self.out, self.shots = server, page, dates, inbox, out, shots
        self.backfill_id = ""  # step 1's backfill and its two runs, checked again once it is recorded
        self.backfill_run_ids: list[str] = []

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"))

    def file_status(self) -> dict[str, str]:
        instance = self.server.instance()
        keys = instance.get_dynamic_partitions(batch_file_partitions.name)
        found = instance.get_status_by_partition(dg.AssetKey("batch_files"), keys, batch_file_partitions) or {}
        return {k: (v.value if v else "MISSING") for k, v in found.items()}

    def date_status(self, asset: str) -> dict[str, str]:
        days = dg.DailyPartitionsDefinition(start_date=self.dates[0], timezone="UTC", end_offset=1)  # the server's
        found = self.server.instance().get_status_by_partition(dg.AssetKey(asset), self.dates, days) or {}
        return {k: (v.value if v else "MISSING") for k, v in found.items()}

    def figures(self, date: str) -> tuple[int, dict[str, Any]]:
        """(storage id, metadata) of throughput_metrics' latest materialization for `date`."""
        records = self.server.instance().fetch_materializations(
            dg.AssetRecordsFilter(dg.AssetKey("throughput_metrics"), asset_partitions=[date]), limit=1).records
        assert records, f"no throughput_metrics for {date}"
        return records[0].storage_id, {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def visible(page: Any, text: str) -> Any:
    """The first visible element with `text` (the UI also renders hidden copies to measure them)."""
    return page.locator(f"text={text} >> visible=true").first


def open_group(server: DagsterDev, page: Any) -> None:
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


def test_backfill_of_two_dates_from_the_ui(ui: Walk) -> None:
    server, page, dates, out = ui.server, ui.page, ui.dates, ui.out
    open_group(server, page)
    ui.shot("1-asset-group")

    page.get_by_role("button", name="Materialize all…").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Launch runs to materialize 4 assets").wait_for()
    partitions = dialog.locator("input[type=text]").first
    partitions.fill(f"[{dates[0]}...{dates[1]}]")
    partitions.press("Enter")
    dialog.get_by_text("2 partitions", exact=True).wait_for()
    ui.shot("2-partition-range")
    dialog.get_by_role("button", name="Launch backfill").click()
    dialog.wait_for(state="detached")

    instance = server.instance()
    [backfill] = wait_for("the backfill in the instance", instance.get_backfills, 30, interval=0.5)
    ui.backfill_id = backfill.backfill_id

    # Its runs, once both finished. The daemon records the backfill's own outcome on its next pass
    # (every 30 s): that, and the backfill's page, are checked while the next run answers
    # (check_backfill_done, from the re-run's step).
    def runs_finished() -> Any:
        found = backfill_runs(server, backfill.backfill_id)
        return found if len(found) == 2 and all(r.is_finished for r in found) else None

    runs = wait_for(f"backfill {backfill.backfill_id}'s two runs finished", runs_finished, BACKFILL_TIMEOUT,
                    interval=0.5, on_timeout=server.log_tail)
    ui.backfill_run_ids = sorted(r.run_id for r in runs)
    # The first date's run succeeds; the second fails on its broken file (and only that file fails).
    by_date = {r.tags["dagster/partition"]: r for r in runs}
    assert sorted(by_date) == dates
    assert (by_date[dates[0]].status.value, by_date[dates[1]].status.value) == ("SUCCESS", "FAILURE")
    for date in dates:
        batch = json.loads((out / date / f"ui-{date}" / "batch.json").read_text())
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert batch["metadata"]["partition"] == date
    assert json.loads((out / dates[1] / "broken" / "batch.json").read_text())["status"] == "failed"

    # On the test run's warm engine the runs hold no gpu pool slot (defs/resources.answering_pool):
    # neither waited for one, and their inference steps may run side by side on the server. (The pool's
    # rule for in-process runs is checked in test_deploy.)
    spans = sorted(step_span(server, r.run_id, "inference_results") for r in runs)
    waited = [r.run_id for r in runs if any("blocked by limit for pool gpu" in (e.message or "")
                                             for e in server.instance().all_logs(r.run_id))]
    print(f"inference_results spans {spans}; runs that waited for the gpu pool: {waited}")
    assert waited == [], f"runs on the warm engine waited for the gpu pool: {waited}"


def new_run_finished(server: DagsterDev, before: set[str]) -> Any:
    """The newest run whose id is not in `before`, once it has finished (None until then)."""
    new = [r for r in server.instance().get_runs() if r.run_id not in before]
    return new[0] if new and new[0].is_finished else None


def backfill_runs(server: DagsterDev, backfill_id: str) -> list[Any]:
    return list(server.instance().get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id})))


def check_backfill_done(ui: Walk) -> None:
    """The backfill of step 1, as the daemon records it once both its runs are over: failed (one
    date failed), with no run but those two, and its page listing them (a Failure and a Success)."""
    server, page = ui.server, ui.page

    def finished() -> Any:
        current = server.instance().get_backfill(ui.backfill_id)
        return current if current.status.value not in ("REQUESTED", "CANCELING") else None

    done = wait_for(f"backfill {ui.backfill_id} finished", finished, BACKFILL_TIMEOUT, interval=0.5,
                    on_timeout=server.log_tail)
    assert done.status.value == "COMPLETED_FAILED", server.log_tail()
    assert sorted(r.run_id for r in backfill_runs(server, ui.backfill_id)) == ui.backfill_run_ids
    page.goto(f"{server.url}/runs/b/{ui.backfill_id}?tab=runs")
    visible(page, "Failure").wait_for()
    visible(page, "Success").wait_for()
    ui.shot("3-backfill")


def test_each_file_shows_on_its_own_the_broken_one_not_green(ui: Walk) -> None:
    server, page, dates = ui.server, ui.page, ui.dates
    # Dagster has no public event for a failed partition: the broken file is not materialized (not
    # green) and its page leads to the observation saying why (file_status.py).
    assert ui.file_status() == {f"{dates[0]}/ui-{dates[0]}": "MATERIALIZED", f"{dates[1]}/ui-{dates[1]}": "MATERIALIZED",
                                f"{dates[1]}/broken": "MISSING"}
    assert ui.date_status("batch_outputs") == {dates[0]: "MATERIALIZED", dates[1]: "FAILED"}
    failed_run = [r for r in server.instance().get_runs() if r.status.value == "FAILURE"][0]
    # A backfill launched from the asset graph runs as Dagster's hidden __ASSET_JOB, which the UI
    # names as no job: the observation names it.
    assert failed_run.job_name == "__ASSET_JOB"
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={dates[1]}/broken")
    visible(page, f"{dates[0]}/ui-{dates[0]}").wait_for()
    # The partition page fills "Latest materialization", Run, Job and Metadata from a materialization
    # only (Dagster's AssetPartitionDetail): None here. Its one link to the reason: the events.
    body = body_with(page, "View all historical events (1)")
    ui.shot("4-batch-files")
    assert "View all historical events (1)" in body, body[:3000]
    visible(page, "View all historical events (1)").click()
    events_dialog = page.get_by_role("dialog")
    events_dialog.get_by_text(failed_run.run_id[:8]).first.wait_for()  # a row: the observation, its run
    events_dialog.get_by_text("Observation").first.click()  # the row opens on its metadata
    shown = ("no_valid_lines", "first_error_lines", "errors.jsonl", "launched from the asset graph")
    for text in shown:
        events_dialog.get_by_text(text).first.wait_for()
    ui.shot("4a-broken-file-historical-events")
    text = events_dialog.inner_text()
    page.keyboard.press("Escape")
    page.goto(f"{server.url}/assets/batch_files?view=events&partition={dates[1]}/broken")
    # The Events tab shows the observation of the step that failed the file: why, where its error
    # lines are, the run ("observed in run ...") and its job.
    expected = ("reason", "no_valid_lines", "error_codes", "invalid_json", "first_error_lines", "1, 2",
                "errors.jsonl", f"observed in run {failed_run.run_id[:8]}",
                "__ASSET_JOB (launched from the asset graph; Dagster's UI names no job for it)")
    events = body_with(page, *expected)
    ui.shot("4b-broken-file-events")
    print("broken file's historical events:", text[:3000], "\nevents tab:", events[:3000])
    for shown in expected:
        assert shown in events, (shown, events[:3000])


def test_the_check_reads_the_same_in_the_list_on_the_node_and_in_its_pane(ui: Walk) -> None:
    """The check's latest execution is what the list and the pane show, and the node shows no
    per-date count ("0 / 1")."""
    server, page = ui.server, ui.page
    [latest] = server.instance().event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("batch_outputs"), "failed_line_rate"), limit=1)
    print("latest failed_line_rate execution:", latest.status, latest.run_id)
    page.goto(f"{server.url}/assets/batch_outputs?view=checks")
    visible(page, "failed_line_rate").wait_for()
    word = {"SUCCEEDED": "Succeeded", "FAILED": "Failed"}.get(latest.status.value, "Execution failed")
    body = body_with(page, word)
    ui.shot("4c-check-list-and-pane")
    print("check page:", body[:3000])
    assert word in body, body[:3000]
    print("other status words on the check page:", [w for w in ("Succeeded", "Failed", "Execution failed") if w in body])
    open_group(server, page)
    ui.shot("4d-check-on-the-lineage-node")
    node = page.inner_text("body")
    assert "0 / 1" not in node, node[:3000]
    print("lineage:", node[:3000])


def test_the_broken_file_fixed_reruns_alone_from_its_partition(ui: Walk) -> None:
    server, page, dates = ui.server, ui.page, ui.dates
    key = f"{dates[1]}/broken"
    (ui.inbox / dates[1] / "broken.jsonl").write_text("\n".join(chat_line(f"fixed-{i}") for i in range(2)) + "\n")
    before = {r.run_id for r in server.instance().get_runs()}
    page.goto(f"{server.url}/assets/batch_files?view=partitions")
    visible(page, key).click()  # the red one
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Launch runs to materialize batch_files").wait_for()
    dialog.get_by_text("1 partition", exact=True).wait_for()  # the selected file, preselected
    ui.shot("5-rerun-one-file")
    print("launch dialog says the model loads:", "loads the model" in dialog.inner_text())
    dialog.get_by_role("button", name="Launch 1 run").click()
    dialog.wait_for(state="detached")
    check_backfill_done(ui)  # while the re-run comes up (step 1's backfill, recorded by now or soon)

    run = wait_for("the re-run of the broken file", lambda: new_run_finished(server, before), BACKFILL_TIMEOUT,
                   interval=0.5, on_timeout=server.log_tail)
    assert run.status.value == "SUCCESS", server.log_tail()
    assert run.tags["dagster/partition"] == key  # that file alone
    fixed = json.loads((ui.out / dates[1] / "broken" / "batch.json").read_text())
    assert fixed["status"] == "completed" and fixed["request_counts"]["completed"] == 2
    assert ui.file_status()[key] == "MATERIALIZED"
    # It records the file only: the date is as its failed run left it until the date runs again.
    assert ui.date_status("batch_outputs") == {dates[0]: "MATERIALIZED", dates[1]: "FAILED"}
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={key}")
    visible(page, "Materialized (3)").wait_for()
    visible(page, "results").wait_for()  # the file's metadata: status, counts, where its results are
    visible(page, "model_load_seconds").wait_for()  # what the model load took this time
    visible(page, "date_assets").wait_for()  # how to record the date with it
    body = body_with(page, run.run_id[:8])
    ui.shot("6-batch-files-after-rerun")
    assert run.run_id[:8] in body  # the run that re-ran it, on the file's page
    assert f"materialize {dates[1]}" in body, body[:3000]
    # The date's figures before its own run: the failed run's story, told once (no later
    # materialization under the banner).
    page.goto(f"{server.url}/assets/throughput_metrics?view=partitions&partition={dates[1]}")
    body = body_with(page, "failed, and did not materialize this asset")
    ui.shot("6b-throughput-before-the-date-run")
    assert "failed, and did not materialize this asset" in body, body[:3000]
    assert re.search(r"Latest materialization\s+None", body), body[:3000]


def test_the_date_run_afterwards_records_the_date_and_names_its_job(ui: Walk) -> None:
    server, page, dates = ui.server, ui.page, ui.dates
    before = {r.run_id for r in server.instance().get_runs()}
    page.goto(f"{server.url}/locations/batch_pipeline/jobs/batch_job")
    page.get_by_role("button", name="Materialize all…").first.click()
    dialog = page.get_by_role("dialog")
    partitions = dialog.locator("input[type=text]").first
    partitions.wait_for()
    partitions.fill(dates[1])
    partitions.press("Enter")
    dialog.get_by_text("1 partition", exact=True).wait_for()
    ui.shot("6c-date-run-from-batch-job")
    dialog.get_by_role("button", name="Launch 1 run").click()
    dialog.wait_for(state="detached")

    run = wait_for("the date's run", lambda: new_run_finished(server, before), BACKFILL_TIMEOUT, interval=0.5,
                   on_timeout=server.log_tail)
    assert run.status.value == "SUCCESS", server.log_tail()
    assert (run.job_name, run.tags["dagster/partition"]) == ("batch_job", dates[1])
    inference = {k: v.value for k, v in server.instance().fetch_materializations(
        dg.AssetRecordsFilter(dg.AssetKey("inference_results"), asset_partitions=[dates[1]]), limit=1,
    ).records[0].asset_materialization.metadata.items()}
    assert "model_load_seconds" not in inference  # nothing left to answer: no model loaded
    assert ui.date_status("batch_outputs") == {dates[0]: "MATERIALIZED", dates[1]: "MATERIALIZED"}
    # The date's page now tells one story: no failure banner, this run and its job.
    page.goto(f"{server.url}/assets/throughput_metrics?view=partitions&partition={dates[1]}")
    body = body_with(page, "batches_this_run", "batch_job")
    ui.shot("6d-throughput-after-the-date-run")
    assert "failed, and did not materialize this asset" not in body, body[:3000]
    assert re.search(r"Job\s+batch_job", body), body[:3000]
    assert run.run_id[:8] in body


def test_sensor_on_afterwards_starts_nothing_and_figures_add_up(ui: Walk) -> None:
    server, page, dates = ui.server, ui.page, ui.dates
    figures_before = {date: ui.figures(date) for date in dates}
    runs_before = len(server.instance().get_runs())
    server.start_sensor("batch_upload_sensor")
    tick = wait_for("a finished sensor tick", lambda: next(
        (t for t in server.sensor_ticks("batch_upload_sensor") if t["status"] in ("SKIPPED", "SUCCESS", "FAILURE")), None),
        120, interval=1.0, on_timeout=server.log_tail)
    assert tick["status"] == "SKIPPED", tick
    time.sleep(2)  # a run it had requested would be in the instance by now
    assert len(server.instance().get_runs()) == runs_before
    for date in dates:
        assert ui.figures(date) == figures_before[date]  # not touched
        per_file = [json.loads(m.read_text()) for m in sorted((ui.out / date).glob("*/metrics.json"))]
        _, totals = figures_before[date]
        assert totals["batches"] == len(per_file) == (2 if date == dates[1] else 1)
        for key in ("requests_completed", "requests_total", "output_tokens"):
            assert totals[key] == sum(m[key] for m in per_file), key
    page.goto(f"{server.url}/assets/throughput_metrics?view=partitions&partition={dates[1]}")
    visible(page, "batches_this_run").wait_for()
    ui.shot("7-throughput-per-date")
    open_group(server, page)
    ui.shot("8-asset-group-after")


def test_a_new_upload_runs_as_batch_job_and_its_page_names_the_job(ui: Walk) -> None:
    server, page, dates = ui.server, ui.page, ui.dates
    before = {r.run_id for r in server.instance().get_runs()}
    (ui.inbox / dates[1] / "late.jsonl").write_text("\n".join(chat_line(f"late-{i}") for i in range(2)) + "\n")

    run = wait_for("the sensor's run of the new upload", lambda: new_run_finished(server, before), BACKFILL_TIMEOUT,
                   interval=0.5, on_timeout=server.log_tail)
    assert run.status.value == "SUCCESS", server.log_tail()
    assert (run.job_name, run.tags["dagster/partition"]) == ("batch_job", dates[1])
    key = f"{dates[1]}/late"
    assert ui.file_status()[key] == "MATERIALIZED"
    page.goto(f"{server.url}/assets/batch_files?view=partitions&partition={key}")
    body = body_with(page, run.run_id[:8], "batch_job")
    ui.shot("9-new-upload-named-job")
    assert re.search(r"Job\s+batch_job", body), body[:3000]  # the sensor's job, on the file's page
    assert run.run_id[:8] in body


def step_span(server: DagsterDev, run_id: str, step: str) -> tuple[float, float]:
    records = server.instance().all_logs(run_id)
    starts = [r.timestamp for r in records if r.step_key == step and r.dagster_event
              and r.dagster_event.event_type == dg.DagsterEventType.STEP_START]
    ends = [r.timestamp for r in records if r.step_key == step and r.dagster_event
            and r.dagster_event.event_type == dg.DagsterEventType.STEP_SUCCESS]
    assert starts and ends, f"no {step} start/success in run {run_id}"
    return starts[0], ends[-1]

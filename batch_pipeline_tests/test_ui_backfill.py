"""The Dagster UI in a real browser: a two-date backfill of the batch assets, launched by clicking.

Covers: Debian's Chromium driven by Playwright against a real `dagster dev` (local folders for
storage, the tiny model); the asset group page renders the four assets; "Materialize all…", a
typed partition range of two dates, "Launch backfill"; the backfill daemon runs both partitions
(two runs that share the `gpu` pool, limit 1: the runs queue for it and do not fail) and each
date's batch.json says completed. Screenshots of each step go to UI_SCREENSHOTS_DIR (default: the
test's tmp folder).

Needs /usr/bin/chromium and the `playwright` package; if either is missing the test runs
scripts/install_browser.sh once and skips, saying so, only if that cannot install them. Playwright
never downloads a browser of its own. Does not cover sensors or S3 (test_dagster_e2e.py).
"""

from __future__ import annotations

import datetime as dt
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

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
def ui(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    playwright = ensure_browser()
    root = tmp_path_factory.mktemp("dagster_ui")
    inbox, out = root / "in", root / "out"
    # Two recent dates: the dialog lists the last 90 days by default.
    today = dt.datetime.now(dt.timezone.utc).date()
    dates = [(today - dt.timedelta(days=d)).isoformat() for d in (9, 8)]
    for date in dates:
        (inbox / date).mkdir(parents=True)
        (inbox / date / f"ui-{date}.jsonl").write_text("\n".join(chat_line(f"{date}-{i}") for i in range(3)) + "\n")
    env = pipeline_env(tiny_model_dir, str(inbox), str(out))
    shots = Path(os.environ.get("UI_SCREENSHOTS_DIR") or root / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    server = start_dagster_dev(root / "home", env, root / "dagster-dev.log")
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(UI_TIMEOUT_MS)
            yield server, page, dates, out, shots
            browser.close()
    finally:
        print(f"dagster dev log: {server.log_path}; screenshots: {shots}")
        server.stop()


def open_group(server: DagsterDev, page: Any) -> None:
    page.goto(f"{server.url}/locations/batch_pipeline/asset-groups/batch")
    for asset in ("validated_requests", "inference_results", "batch_outputs", "throughput_metrics"):
        page.get_by_text(asset, exact=True).first.wait_for()


def test_backfill_of_two_dates_from_the_ui(ui) -> None:
    server, page, dates, out, shots = ui
    open_group(server, page)
    page.screenshot(path=str(shots / "1-asset-group.png"))

    page.get_by_role("button", name="Materialize all…").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Launch runs to materialize 4 assets").wait_for()
    partitions = dialog.locator("input[type=text]").first
    partitions.fill(f"[{dates[0]}...{dates[1]}]")
    partitions.press("Enter")
    dialog.get_by_text("2 partitions", exact=True).wait_for()
    page.screenshot(path=str(shots / "2-partition-range.png"))
    dialog.get_by_role("button", name="Launch backfill").click()
    dialog.wait_for(state="detached")
    page.screenshot(path=str(shots / "3-launched.png"))

    instance = server.instance()
    [backfill] = wait_for("the backfill in the instance", instance.get_backfills, 30)

    def finished() -> Any:
        current = server.instance().get_backfill(backfill.backfill_id)
        return current if current.status.value not in ("REQUESTED", "CANCELING") else None

    done = wait_for(f"backfill {backfill.backfill_id} finished", finished, BACKFILL_TIMEOUT, interval=3.0,
                    on_timeout=server.log_tail)
    page.goto(f"{server.url}/runs/b/{backfill.backfill_id}?tab=partitions")
    page.get_by_text("Succeeded").first.wait_for()
    page.screenshot(path=str(shots / "4-backfill.png"))
    assert done.status.value == "COMPLETED_SUCCESS", server.log_tail()

    for date in dates:
        batch = json.loads((out / date / f"ui-{date}" / "batch.json").read_text())
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert batch["metadata"]["partition"] == date

    # One gpu slot for two runs: their inference steps never overlapped, and neither failed.
    runs = server.instance().get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill.backfill_id}))
    assert sorted(r.tags["dagster/partition"] for r in runs) == dates
    assert all(r.status.value == "SUCCESS" for r in runs)
    spans = sorted(step_span(server, r.run_id, "inference_results") for r in runs)
    assert spans[0][1] <= spans[1][0], f"inference steps overlapped: {spans}"
    blocked = [r.run_id for r in runs if any("blocked by limit for pool gpu" in (e.message or "")
                                              for e in server.instance().all_logs(r.run_id))]
    print(f"inference_results spans {spans}; runs that waited for the gpu pool: {blocked}")

    open_group(server, page)
    page.screenshot(path=str(shots / "5-asset-group-after.png"))


def step_span(server: DagsterDev, run_id: str, step: str) -> tuple[float, float]:
    records = server.instance().all_logs(run_id)
    starts = [r.timestamp for r in records if r.step_key == step and r.dagster_event
              and r.dagster_event.event_type == dg.DagsterEventType.STEP_START]
    ends = [r.timestamp for r in records if r.step_key == step and r.dagster_event
            and r.dagster_event.event_type == dg.DagsterEventType.STEP_SUCCESS]
    assert starts and ends, f"no {step} start/success in run {run_id}"
    return starts[0], ends[-1]

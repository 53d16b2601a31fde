"""Tests for the Prometheus alerting rules in deploy/prometheus/ and how the deploy loads them.

Covers: every rule of deploy/prometheus/alerts.yaml has a severity and a summary; every metric a rule
of the `batch-pipeline-api` group names, with its label values, is on the /metrics page of a real
Batch API app (create_app over service_from_env, a store of past batches written as the service
writes them and one still queued, today's metrics.parquet, a stub Dagster GraphQL endpoint answering
the queued runs), or is Prometheus' own
`up` for the scrape job the deploy configures; the `batch-pipeline-kubernetes` group names only
kube-state-metrics series; the compose `prometheus` service and the Helm chart load that same file
and scrape the job the rules name. The figures the newer rules read have the store's values: the
oldest queued run's age, the seconds to the open batch's deadline, and the lines of today's file
batches (the API's batch in the same table left out). Where `promtool` is installed (Debian's `prometheus` package),
`promtool check rules` and the rule unit tests in deploy/prometheus/alerts.test.yaml run too (each
rule firing on made-up series, and staying quiet where it should); elsewhere that test is skipped.

Does not start Prometheus, Dagster or a server process: the app is driven in-process by FastAPI's
TestClient; the Helm template is read as text (no Helm here).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

from batch_pipeline_tests.support import REPO
from batch_pipeline_tests.support.api_history import write_history

PROMETHEUS = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS / "alerts.yaml"
API_GROUP, KUBE_GROUP = "batch-pipeline-api", "batch-pipeline-kubernetes"
SCRAPE_JOB = "batch-api"
# Series Prometheus writes itself for every scrape target.
PROMETHEUS_OWN = {"up"}
# kube-state-metrics 2.x names the Kubernetes rules may use (its docs: pod-metrics.md, job-metrics.md).
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total", "kube_pod_container_status_waiting_reason",
                      "kube_job_status_failed"}

KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "atan2",
            # aggregation operators: `sum without (x) (...)` puts the label list before the parentheses
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


# ----------------------------------------------------------------------------------- PromQL


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value} of its `=` matchers) of every vector selector in a PromQL
    expression: a small scanner, enough for these rules (functions, aggregations with by/without,
    binary operators with on/ignoring, ranges, subqueries, offsets, strings)."""
    found: list[tuple[str, dict[str, str]]] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'":
            i = expr.index(c, i + 1) + 1
        elif c == "[":
            i = expr.index("]", i) + 1
        elif c.isdigit():
            while i < n and (expr[i].isalnum() or expr[i] == "."):
                i += 1
        elif c.isalpha() or c in "_:":
            j = i
            while j < n and (expr[j].isalnum() or expr[j] in "_:"):
                j += 1
            word, k = expr[i:j], j
            while k < n and expr[k].isspace():
                k += 1
            if word in GROUPING and k < n and expr[k] == "(":
                i = expr.index(")", k) + 1  # a label list, not selectors
            elif k < n and expr[k] == "(" or word.lower() in KEYWORDS:
                i = j  # a function or an operator keyword
            elif k < n and expr[k] == "{":
                end = expr.index("}", k)
                matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', expr[k:end]))
                found.append((word, matchers))
                i = end + 1
            else:
                found.append((word, {}))
                i = j
        else:
            i += 1
    return found


def test_the_scanner_reads_selectors_not_functions_keywords_or_label_lists():
    expr = ('sum without (result) (delta(a_b{result="completed", x=~"y"}[1h])) / on () group_left c '
            'and absent(d) or e offset 1h > 0.99 unless delta(sum by (ns) (f{job_name=~"r-.*"})[1h:5m])')
    assert selectors(expr) == [("a_b", {"result": "completed"}), ("c", {}), ("d", {}), ("e", {}), ("f", {})]


# ------------------------------------------------------------------------------ the rules


def rule_groups() -> dict[str, list[dict[str, Any]]]:
    return {g["name"]: g["rules"] for g in yaml.safe_load(RULES.read_text())["groups"]}


def test_every_rule_has_a_severity_a_summary_and_a_description():
    groups = rule_groups()
    assert set(groups) == {API_GROUP, KUBE_GROUP}
    names = [r["alert"] for rules in groups.values() for r in rules]
    assert len(names) == len(set(names))
    for rule in (r for rules in groups.values() for r in rules):
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert selectors(rule["expr"]), rule["alert"]


def test_the_issues_four_alerts_are_there():
    names = {r["alert"] for rules in rule_groups().values() for r in rules}
    assert {"BatchLineSuccessRateLow", "BatchRunQueuedTooLong", "BatchesExpired",
            "BatchRunWorkersFailingRepeatedly", "BatchPipelineContainerRestartLoop"} <= names
    (rate,) = [r for r in rule_groups()[API_GROUP] if r["alert"] == "BatchLineSuccessRateLow"]
    assert "< 0.99" in rate["expr"]


QUEUED_AGES = (600, 120, 30)  # seconds each stub queued run has waited


class _GraphQL(BaseHTTPRequestHandler):
    """Dagster's web server as the service sees it: any query answers 3 queued runs, created
    QUEUED_AGES ago (no run carries a batch: those queries read other fields)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        runs = [{"creationTime": time.time() - age} for age in QUEUED_AGES]
        body = json.dumps({"data": {"runsOrError": {"__typename": "Runs", "count": 3, "results": runs}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


OPEN_EXPIRY = 5400
# Today's metrics.parquet: (batch folder, completed, failed); "API" is a Batch API batch's folder.
FILE_ROWS = (("upload-a.jsonl", 90, 10), ("nightly.jsonl", 200, 0), ("API", 18, 2))


@pytest.fixture
def metrics_page(tmp_path, monkeypatch) -> str:
    """The /metrics page of a real Batch API app over a store of 60 past batches of every terminal
    status (expired ones included), one still queued (its deadline OPEN_EXPIRY ahead), today's
    metrics.parquet (FILE_ROWS: two file batches and an API one) and a stub Dagster answering the
    queued runs."""
    from fastapi.testclient import TestClient

    from batch_pipeline.service.app import create_app, service_from_env

    server = ThreadingHTTPServer(("127.0.0.1", 0), _GraphQL)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "out"
        past = write_history(out, 60, ["team-a", "team-b"])
        open_batch = {**past[-1], "id": "batch_stillqueued", "output_uri": str(out / "none"),
                      "expires_at": int(time.time()) + OPEN_EXPIRY}
        (out / "_batch_api" / "batches" / "batch_stillqueued.json").write_text(json.dumps(open_batch))
        from batch_pipeline.io.tables import write_metrics_table
        from batch_pipeline.service.prometheus import recent_dates

        rows = [{"batch": name, "requests_completed": c, "requests_failed": f} for name, c, f in FILE_ROWS]
        write_metrics_table(str(out / recent_dates()[1] / "metrics.parquet"), [
            {**row, "batch": past[0]["id"] if row["batch"] == "API" else row["batch"]} for row in rows])
        for name in list(__import__("os").environ):
            if name.startswith("BATCH_API_"):
                monkeypatch.delenv(name)
        monkeypatch.setenv("BATCH_API_KEYS", "team-a:key-a-0123456789,team-b:key-b-0123456789")
        monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(out))
        monkeypatch.setenv("STORAGE_INPUT_PATH", str(tmp_path / "in"))
        monkeypatch.setenv("DAGSTER_WEBSERVER_URL", f"http://127.0.0.1:{server.server_address[1]}")
        with TestClient(create_app(service_from_env())) as client:
            response = client.get("/metrics", headers={"Authorization": "Bearer key-a-0123456789"})
        assert response.status_code == 200, response.text
        return response.text
    finally:
        server.shutdown()
        server.server_close()


def exposition(page: str) -> dict[str, list[dict[str, str]]]:
    """{metric name: [its label sets]} of a Prometheus text page."""
    series: dict[str, list[dict[str, str]]] = {}
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+$", line)
        assert m, f"not a sample line: {line!r}"
        series.setdefault(m.group(1), []).append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
    return series


def test_api_rules_name_only_metrics_and_label_values_the_service_exposes(metrics_page):
    exposed = exposition(metrics_page)
    assert "batch_pipeline_api_queued_runs" in exposed  # the stub answered: every figure is there
    for rule in rule_groups()[API_GROUP]:
        for name, matchers in selectors(rule["expr"]):
            if name in PROMETHEUS_OWN:
                assert matchers == {"job": SCRAPE_JOB}, f"{rule['alert']}: {name}{matchers}"
                continue
            assert name in exposed, f"{rule['alert']} names {name}, which /metrics does not expose"
            matchers.pop("job", None)
            assert any(matchers.items() <= labels.items() for labels in exposed[name]), (
                f"{rule['alert']}: no {name} series on /metrics has {matchers}; it has {exposed[name]}")


def test_the_line_figures_the_success_rate_reads_are_those_of_the_store(metrics_page):
    exposed = {(name, tuple(sorted(labels.items()))): float(line.rsplit(" ", 1)[1])
               for line in metrics_page.splitlines() if line and not line.startswith("#")
               for name, labels in [(line.split("{")[0].split(" ")[0], dict(re.findall(r'(\w+)="([^"]*)"', line)))]}
    # 60 batches: statuses cycle completed x3, failed, cancelled, expired; 20 lines each, 2 failed in batch 0.
    finished_with_usage = [i for i in range(60) if i % 6 != 3]
    completed = sum(18 if i % 50 == 0 else 20 for i in finished_with_usage)
    assert exposed[("batch_pipeline_api_lines", (("result", "completed"),))] == completed
    assert exposed[("batch_pipeline_api_lines", (("result", "failed"),))] == 4  # batches 0 and 50
    assert exposed[("batch_pipeline_api_batches", (("status", "expired"),))] == 10


def test_the_figures_the_queue_expiry_and_file_rules_read(metrics_page):
    from batch_pipeline.service.prometheus import recent_dates

    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics_page.splitlines() if line and not line.startswith("#")}
    assert values["batch_pipeline_api_queued_runs"] == 3
    assert max(QUEUED_AGES) <= values["batch_pipeline_api_oldest_queued_run_age_seconds"] < max(QUEUED_AGES) + 60
    assert OPEN_EXPIRY - 60 < values["batch_pipeline_api_next_expiry_seconds"] <= OPEN_EXPIRY  # the open batch's
    yesterday, today = recent_dates()
    # The two file batches of today; the API's batch is in batch_pipeline_api_lines, not here.
    assert values[f'batch_pipeline_file_lines{{date="{today}",result="completed"}}'] == 290
    assert values[f'batch_pipeline_file_lines{{date="{today}",result="failed"}}'] == 10
    assert values[f'batch_pipeline_file_lines{{date="{yesterday}",result="completed"}}'] == 0  # no table: 0


def test_kubernetes_rules_name_only_kube_state_metrics():
    for rule in rule_groups()[KUBE_GROUP]:
        for name, matchers in selectors(rule["expr"]):
            assert name in KUBE_STATE_METRICS, f"{rule['alert']}: {name} is not a kube-state-metrics series"
            assert matchers.get("namespace") == "batch-pipeline", rule["alert"]  # deploy/README.md's namespace


# ------------------------------------------------------------------------------ the deploy


def test_compose_prometheus_loads_the_rules_and_scrapes_the_batch_api():
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())
    prom = compose["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]  # opt-in: `up` without the profile starts what it did
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"])
    mounts = {m.split(":")[1]: m.split(":")[0] for m in prom["volumes"] if m.startswith("./")}
    config = yaml.safe_load((PROMETHEUS / "prometheus.yaml").read_text())
    assert [mounts[path] for path in config["rule_files"]] == ["./prometheus/alerts.yaml"]
    assert mounts["/etc/prometheus/prometheus.yaml"] == "./prometheus/prometheus.yaml"
    assert all(m.endswith(":ro") for m in prom["volumes"] if m.startswith("./"))
    (job,) = config["scrape_configs"]
    assert job["job_name"] == SCRAPE_JOB and job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["batch-api:8000"]
    assert "8000" in compose["services"]["batch-api"]["command"]
    # The key from a compose secret (a file ignored by git), never in the config.
    assert job["authorization"]["credentials_file"] == "/run/secrets/metrics_key"
    assert compose["secrets"]["metrics_key"]["file"] == "./metrics-key.txt"
    assert "metrics-key.txt" in (REPO / "deploy" / ".gitignore").read_text().split()
    assert all(p.startswith("127.0.0.1:") for p in prom["ports"])


def test_helm_renders_the_same_rules_and_scrapes_as_the_job_the_rules_name():
    values = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
    monitoring = values["batchApi"]["monitoring"]
    assert monitoring["enabled"] is False and monitoring["rules"] == ""  # CRDs needed: opt-in
    template = (REPO / "deploy" / "helm" / "batch-api" / "templates" / "monitoring.yaml").read_text()
    assert "kind: PrometheusRule" in template and "kind: ServiceMonitor" in template
    assert "--set-file batchApi.monitoring.rules=deploy/prometheus/alerts.yaml" in template
    assert re.search(r"targetLabel: job\s+replacement: " + SCRAPE_JOB, template)
    assert "$api.monitoring.keySecretName" in template
    # What --set-file passes is the rule file itself: a PrometheusRule spec is its `groups:`.
    assert set(yaml.safe_load(RULES.read_text())) == {"groups"}


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run([promtool, "test", "rules", "alerts.test.yaml"], cwd=PROMETHEUS, capture_output=True,
                           text=True, timeout=120)
    assert tests.returncode == 0, tests.stdout + tests.stderr

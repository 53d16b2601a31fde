"""What Batch API batches cost, and what create reads: `batch-pipeline serve` over a real `dagster dev`
(its daemon running the tiny model on the CPU), driven by the openai SDK.

Covered: each finished batch's Batch object carries its cost as `cost_*` metadata (0 GPUs on the
CPU, engine-seconds, model load seconds, tokens equal to its usage), the same figures are in its
metrics.json, and across a tenant's batches they add up to the tenant's counters on /metrics and to
its row of `batch-pipeline usage` (table and CSV, `--tenant`, `--since`). Without a server: the
counters' label values are escaped and their sums exact.

Not covered: GPU-seconds on a GPU (no GPU here; the arithmetic is engine-seconds x GPUs).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline_tests.support.api_service import RUN_TIMEOUT, client, request_line, serve_env, service_stack, upload
from batch_pipeline_tests.support import wait_for

KEY_A, KEY_B = "key-usage-a-0123456789", "key-usage-b-0123456789"
COST_KEYS = {"cost_gpus", "cost_engine_seconds", "cost_gpu_seconds", "cost_model_load_seconds", "cost_input_tokens",
             "cost_output_tokens"}
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, warm_engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    keys = {"BATCH_API_KEYS": f"team-a:{KEY_A},team-b:{KEY_B}"}
    with service_stack(tmp_path_factory.mktemp("usage"), tiny_model_dir, keys, engine_url=warm_engine_url) as s:
        yield s


def finished(sdk: Any, batch_id: str, server: Any) -> Any:
    def done() -> Any:
        batch = sdk.batches.retrieve(batch_id)
        return batch if batch.status in TERMINAL else None

    return wait_for(f"batch {batch_id} finished", done, RUN_TIMEOUT, interval=1.0, on_timeout=server.log_tail)


def usage_command(out: Path, *args: str) -> str:
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "usage", *args], capture_output=True,
                          text=True, env=serve_env({"STORAGE_OUTPUT_PATH": str(out)}), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_cost_adds_up_per_tenant_on_the_batch_in_metrics_and_in_usage(stack, warm_engine_url):
    """Three batches of two tenants on the test run's warm engine (docs/ENGINE.md's rule: a run's
    engine time is its answering time x its share of the tokens the engine computed meanwhile; no
    model loaded by the run). The in-process figures (a model load of its own) are test_assets' and
    test_cli's."""
    a, b = client(stack["url"], KEY_A), client(stack["url"], KEY_B)
    made = [(tenant, sdk, sdk.batches.create(input_file_id=upload(sdk, [request_line(f"{name}-{i}") for i in range(n)]).id,
                                             endpoint="/v1/chat/completions", completion_window="24h",
                                             metadata={"job": name}))
            for tenant, sdk, name, n in (("team-a", a, "a1", 3), ("team-a", a, "a2", 2), ("team-b", b, "b1", 2))]
    sums: dict[str, dict[str, float]] = {}
    model = None
    for tenant, sdk, batch in made:
        done = finished(sdk, batch.id, stack["server"])
        assert done.status == "completed", (done, stack["server"].log_tail())
        meta = done.metadata
        assert COST_KEYS <= set(meta) and meta["job"] == batch.metadata["job"]  # the batch's own metadata kept
        assert all(isinstance(meta[k], str) for k in COST_KEYS)  # the SDK keeps string values
        assert meta["cost_gpus"] == "0" and float(meta["cost_gpu_seconds"]) == 0.0  # the CPU: no GPU held
        assert float(meta["cost_model_load_seconds"]) == 0.0 < float(meta["cost_engine_seconds"])  # warm: nothing loaded
        assert int(meta["cost_input_tokens"]) == done.usage.input_tokens > 0
        assert int(meta["cost_output_tokens"]) == done.usage.output_tokens > 0
        # The throughput figures say the same.
        [metrics_file] = stack["out"].glob(f"????-??-??/{batch.id}/metrics.json")
        figures = json.loads(metrics_file.read_text())
        assert (figures["gpus"], figures["gpu_seconds"]) == (0, 0.0)
        assert figures["engine_seconds"] == float(meta["cost_engine_seconds"])
        assert figures["model_load_seconds"] == float(meta["cost_model_load_seconds"])
        assert figures["engine_url"] == warm_engine_url and 0 < figures["engine_token_share"] <= 1, figures
        # The engine time charged is the answering time, cut by the batch's token share.
        assert figures["engine_seconds"] <= figures["inference_seconds"] + 0.01, figures
        model = done.model
        tenant_sums = sums.setdefault(tenant, {"batches": 0})
        tenant_sums["batches"] += 1
        for key in COST_KEYS:
            tenant_sums[key] = tenant_sums.get(key, 0.0) + float(meta[key])

    # /metrics: counters by tenant and model, each the sum over the tenant's finished batches.
    request = urllib.request.Request(f"{stack['serve'].base}/metrics", headers={"Authorization": f"Bearer {KEY_B}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    assert "# TYPE batch_pipeline_api_cost_gpu_seconds_total counter" in text

    def counter(name: str, tenant: str) -> float:
        [value] = re.findall(rf'^batch_pipeline_api_cost_{name}_total{{tenant="{tenant}",model="{re.escape(model)}"}} '
                             r"(\S+)$", text, re.M)
        return float(value)

    for tenant, tenant_sums in sums.items():
        assert counter("batches", tenant) == tenant_sums["batches"]
        for field in ("engine_seconds", "model_load_seconds", "gpu_seconds", "input_tokens", "output_tokens"):
            assert counter(field, tenant) == pytest.approx(tenant_sums[f"cost_{field}"], abs=0.002), field

    # `batch-pipeline usage`: a row per tenant and model, from the service's records.
    today = dt.datetime.now(dt.timezone.utc).date()
    rows = list(csv.DictReader(io.StringIO(usage_command(stack["out"], "--since", today.isoformat(), "--csv"))))
    assert [(r["tenant"], r["model"]) for r in rows] == [("team-a", model), ("team-b", model)]
    for row in rows:
        tenant_sums = sums[row["tenant"]]
        assert int(row["batches"]) == tenant_sums["batches"]
        assert int(row["input_tokens"]) == tenant_sums["cost_input_tokens"]
        assert int(row["output_tokens"]) == tenant_sums["cost_output_tokens"]
        for field in ("engine_seconds", "gpu_seconds", "model_load_seconds"):
            assert float(row[field]) == pytest.approx(tenant_sums[f"cost_{field}"], abs=0.002), field
    table = usage_command(stack["out"], "--since", today.isoformat(), "--tenant", "team-b").splitlines()
    assert table[0].split() == ["tenant", "model", "batches", "input_tokens", "output_tokens", "engine_seconds",
                                "gpu_seconds", "model_load_seconds"]
    assert [line.split()[:3] for line in table[1:]] == [["team-b", model, "1"]]
    later = (today + dt.timedelta(days=1)).isoformat()
    assert usage_command(stack["out"], "--since", later).splitlines()[1:] == []


def test_metric_labels_are_escaped_and_sums_exact():
    from batch_pipeline.service.prometheus import prometheus

    tenant = 'team "a"\\'  # an operator's free text: quotes and a backslash
    batch = {"status": "completed", "model": 'm"1', "request_counts": {"completed": 1, "failed": 0},
             "usage": {"input_tokens": 1234567, "output_tokens": 2},
             "metadata": {"cost_gpus": "2", "cost_engine_seconds": "1.5", "cost_gpu_seconds": "3.0",
                          "cost_model_load_seconds": "0.5", "cost_input_tokens": "1234567", "cost_output_tokens": "2"}}
    text = prometheus([(tenant, batch), (tenant, batch)], files=0, queued=None)
    assert 'batch_pipeline_api_cost_input_tokens_total{tenant="team \\"a\\"\\\\",model="m\\"1"} 2469134\n' in text
    assert 'batch_pipeline_api_cost_gpu_seconds_total{tenant="team \\"a\\"\\\\",model="m\\"1"} 6\n' in text


def test_cost_counts_the_gpus_the_engines_used_not_every_gpu_the_run_saw():
    from batch_pipeline.steps.metrics import batch_cost

    usage = {"input_tokens": 10, "output_tokens": 5}
    seen_8 = {"model_load_seconds": 10.0, "inference_seconds": 90.0, "gpu": {"gpu_count": 8}}
    assert batch_cost({**seen_8, "engine_gpus": 2}, usage)["gpu_seconds"] == 200.0  # TP 2 of the 8 it could see
    assert batch_cost({**seen_8, "engine_gpus": 16}, usage)["gpus"] == 8  # never more than it could see
    assert batch_cost(seen_8, usage)["gpus"] == 8  # a record from before engine_gpus: what it saw
    cpu = batch_cost({**seen_8, "gpu": {}, "engine_gpus": 1}, usage)
    assert (cpu["gpus"], cpu["gpu_seconds"], cpu["engine_seconds"]) == (0, 0.0, 100.0)

"""ORDER=planned against ORDER=input on real runs of the bundled SmolLM2 (greedy, so answers are
comparable): the same output, error and results files byte for byte apart from ids, timings and
prefix-cache counts, and the figures the plan adds (ordering, planning_seconds,
prefix_cache_hit_rate) in metrics.json and the throughput_metrics materialization. The date holds
two files asking about the same documents: planned, they are answered as one stream. The plan itself
is tested in test_ordering.py; a kill -9 mid-run resumed under the plan in test_reliability.py.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.resources import BatchSelection, StorageResource

pytestmark = pytest.mark.smollm2

DATE = "2026-11-20"
MODEL = "SmolLM2-135M-Instruct"
# What differs between two runs of one file whatever the order: generated ids, clocks, and how
# many prompt tokens the prefix cache happened to serve (the plan's whole point).
VOLATILE = re.compile(rb'"(id|request_id|batch_id|created|created_at|cached_tokens)": ?("[^"]*"|\d+)')


def batch_lines() -> list[str]:
    """Documents x questions, shuffled, with other kinds of line among them: completions, an
    embeddings line, lines validation refuses and a prompt too long for the context."""
    rng = random.Random(11)
    lines = []
    for d in range(4):
        doc = f"Report {d}: the warehouse in city {d} shipped {100 + d} crates of item {d * 3} this week. " * 6
        for q, question in enumerate(("How many crates shipped?", "Which city?", "Which item?")):
            body = {"model": MODEL, "messages": [{"role": "system", "content": "Answer in a few words."},
                                                 {"role": "user", "content": f"{doc}\n{question}"}],
                    "max_tokens": rng.choice([4, 8, 12]), "temperature": 0}
            lines.append({"custom_id": f"doc{d}-q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    lines.append({"custom_id": "complete", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}})
    lines.append({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "all-MiniLM-L6-v2", "input": "crates shipped"}})
    lines.append({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}})
    rng.shuffle(lines)
    text = [json.dumps(line) for line in lines]
    text.insert(3, "{not json")
    text.insert(9, json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}))
    return text


def more_lines() -> list[str]:
    """A second file of the date: other questions about the same documents."""
    lines = []
    for d in (2, 0, 3, 1):
        doc = f"Report {d}: the warehouse in city {d} shipped {100 + d} crates of item {d * 3} this week. " * 6
        body = {"model": MODEL, "messages": [{"role": "system", "content": "Answer in a few words."},
                                             {"role": "user", "content": f"{doc}\nWhat was shipped?"}],
                "max_tokens": 6, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"more-{d}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return lines


def run(llm, folder: Path, order: str) -> tuple[Path, dg.ExecuteInProcessResult]:
    inbox, out = folder / "in", folder / f"out-{order}"
    (inbox / DATE).mkdir(parents=True, exist_ok=True)
    (inbox / DATE / "docs.jsonl").write_text("\n".join(batch_lines()) + "\n")
    (inbox / DATE / "more.jsonl").write_text("\n".join(more_lines()) + "\n")
    result = dg.materialize(
        BATCH_ASSETS, partition_key=DATE, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
        resources={"batch": BatchSelection(), "llm": llm.rebuilt(order=order),
                   "storage": StorageResource(input_path=str(inbox), output_path=str(out))},
    )
    assert result.success
    return out / DATE / "docs", result


def masked(path: Path) -> bytes:
    return VOLATILE.sub(rb'"\1":_', path.read_bytes())


def test_planned_order_changes_nothing_a_user_sees(smollm2_llm, tmp_path):
    planned, planned_run = run(smollm2_llm, tmp_path, "planned")
    plain, _ = run(smollm2_llm, tmp_path, "input")

    for name in ("output.jsonl", "errors.jsonl"):
        assert masked(planned / name) == masked(plain / name), name
        assert masked(planned.parent / "more" / name) == masked(plain.parent / "more" / name), f"more/{name}"
    more = [json.loads(line) for line in (planned.parent / "more" / "output.jsonl").read_text().split("\n") if line]
    assert [o["custom_id"] for o in more] == ["more-2", "more-0", "more-3", "more-1"]
    outputs = [json.loads(line) for line in (planned / "output.jsonl").read_text().split("\n") if line]
    errors = [json.loads(line) for line in (planned / "errors.jsonl").read_text().split("\n") if line]
    assert len(outputs) == 14 and len(errors) == 3  # 12 chat, completion, embedding; 2 invalid, too long
    # Input order: the file's order of custom_ids, in both files (errors merged with invalid lines).
    file_order = [json.loads(line).get("custom_id") if line.startswith("{\"") else None for line in batch_lines()]
    assert [o["custom_id"] for o in outputs] == [c for c in file_order if c and c in {o["custom_id"] for o in outputs}]
    assert [e["custom_id"] for e in errors] == [c for c in file_order if c not in {o["custom_id"] for o in outputs}]

    table, table_plain = pq.read_table(planned / "results.parquet"), pq.read_table(plain / "results.parquet")
    assert table.column("line").to_pylist() == sorted(table.column("line").to_pylist())
    for column in ("line", "custom_id", "status", "content", "error_code"):
        if column in table.column_names:
            assert table.column(column).to_pylist() == table_plain.column(column).to_pylist(), column

    batch, batch_plain = (json.loads((p / "batch.json").read_text()) for p in (planned, plain))
    assert batch["request_counts"] == batch_plain["request_counts"] == {"total": 17, "completed": 14, "failed": 3}
    assert batch["usage"]["input_tokens"] == batch_plain["usage"]["input_tokens"]
    assert batch["usage"]["output_tokens"] == batch_plain["usage"]["output_tokens"]

    metrics, metrics_plain = (json.loads((p / "metrics.json").read_text()) for p in (planned, plain))
    assert metrics["ordering"] == "planned" and metrics_plain["ordering"] == "input"
    assert metrics["planning_seconds"] > 0 and metrics_plain["planning_seconds"] == 0
    cached = batch["usage"]["input_tokens_details"]["cached_tokens"]
    assert metrics["prefix_cache_hit_rate"] == round(cached / batch["usage"]["input_tokens"], 4) > 0
    assert 0 <= metrics["engine_idle_share"] < 1

    # Planned, the date's two files were one stream: each record names the other, and the stream's
    # time is shared out between them (their seconds add up; ORDER=input answered them in turn).
    records = {name: json.loads((planned.parent / name / "_work" / "inference.json").read_text()) for name in ("docs", "more")}
    assert records["docs"]["answered_with"] == ["more"] and records["more"]["answered_with"] == ["docs"]
    assert records["docs"]["inference_started_at"] == records["more"]["inference_started_at"]
    assert records["docs"]["inference_seconds"] > records["more"]["inference_seconds"] > 0  # 13 answers against 4
    assert "answered_with" not in json.loads((plain.parent / "more" / "_work" / "inference.json").read_text())
    more_batch = json.loads((planned.parent / "more" / "batch.json").read_text())
    assert more_batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}

    [event] = [e for e in planned_run.get_asset_materialization_events()
               if e.asset_key.to_user_string() == "throughput_metrics"]
    figures = {k: v.value for k, v in event.materialization.metadata.items()}
    assert figures["ordering"] == "planned"
    # The date's figures: both files'.
    usage = [json.loads((planned.parent / name / "batch.json").read_text())["usage"] for name in ("docs", "more")]
    rate = sum(u["input_tokens_details"]["cached_tokens"] for u in usage) / sum(u["input_tokens"] for u in usage)
    assert figures["prefix_cache_hit_rate"] == pytest.approx(rate, abs=1e-3)  # rounded to 3 places
    both = records["docs"]["planning_seconds"] + records["more"]["planning_seconds"]
    assert figures["planning_seconds"] == pytest.approx(both, abs=2e-3) and figures["planning_seconds"] > 0

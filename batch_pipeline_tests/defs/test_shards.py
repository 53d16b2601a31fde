"""Line-range shards: one batch answered by several runs (on several servers), one set of results.

- the ranges: contiguous, disjoint, covering every valid request; bad `i/n` refused by name;
- the merge of the shards' records (balance summed per rank, time counted once when side by side);
- the upload sensor with SHARDS=n starts n runs with their own run keys;
- Dagster runs of shard 1/2 then 2/2 (the session's tiny engine): the first writes no results,
  the second writes one set, every line once, and metrics say 2 shards; on SmolLM2, shards in
  either order give one run's (right) greedy answers;
- two `batch-pipeline run --shard i/2` processes at the same time, as two servers would: one set
  of results, each line answered once, the same greedy answers as one process on the whole batch
  (the test process's run_batch on the session's tiny engine).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from batch_pipeline.defs.jobs import run_batch
from batch_pipeline.defs.jobs import batch_run_config
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.io import shards
from batch_pipeline.config.settings import ConfigError, shards_from_env
from batch_pipeline_tests.support.asset_runs import DATE, chat_line, materialize, metadata_of, read_jsonl
from batch_pipeline_tests.support.asset_runs import write_batch as write_date_batch
from batch_pipeline_tests.support.cli_runs import CLI, answered_once, read_results, write_batch
from batch_pipeline_tests.support import tiny_env
from batch_pipeline_tests.support.sensor_ticks import evaluate, turned_on, write


@pytest.mark.parametrize("valid", [0, 1, 7, 10, 1001])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_shards_cover_every_request_once_in_contiguous_ranges(valid, count):
    ranges = [shards.Shard(i, count).positions(valid) for i in range(1, count + 1)]
    assert [p for r in ranges for p in r] == list(range(valid))
    assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1


@pytest.mark.parametrize("text,message", [
    ("3/2", "shard 3/2 does not exist"), ("0/2", "shard 0/2 does not exist"),
    ("two", "shard='two' is not a shard: write i/n"), ("1/0", "shard 1/0 does not exist"),
])
def test_bad_shards_are_refused_by_name(text, message):
    with pytest.raises(ConfigError, match=message):
        shards.Shard.parse(text)
    assert shards.Shard.parse(" 2 / 4 ") == shards.Shard(2, 4) and shards.Shard.parse("").whole


def test_merged_record_counts_side_by_side_time_once_and_sums_the_balance():
    assert shards.busy_seconds([(0, 10), (5, 12)]) == 12  # side by side on two servers
    assert shards.busy_seconds([(0, 5), (10, 15)]) == 10  # one after another
    base = {"checkpoint_key": "k", "engine": {"m": 1}, "finished_at": 20, "checkpoint_parts": 2}
    merged = shards.merge_records([
        {**base, "resumed_requests": 1, "computed_requests": 4, "in_progress_at": 3, "model_load_seconds": 5.0,
         "inference_started_at": 10.0, "inference_finished_at": 20.0, "data_parallel_size": 2, "requests_per_rank": [2, 2]},
        {**base, "resumed_requests": 0, "computed_requests": 5, "in_progress_at": 1, "model_load_seconds": 7.0,
         "inference_started_at": 15.0, "inference_finished_at": 30.0, "data_parallel_size": 1, "requests_per_rank": [5]},
    ])
    assert merged["shards"] == 2 and merged["requests_per_rank"] == [7, 2] and merged["data_parallel_size"] == 2
    assert merged["inference_seconds"] == 20.0 and merged["model_load_seconds"] == 7.0
    assert (merged["resumed_requests"], merged["computed_requests"], merged["in_progress_at"]) == (1, 9, 1)


def test_the_upload_sensor_starts_one_run_per_shard(tmp_path, monkeypatch):
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")  # 2026-11-20 may be outside the default window
    on = turned_on(storage)
    write(tmp_path / "in" / "2026-11-20" / "big.jsonl")
    monkeypatch.setenv("SHARDS", "3")
    requests = evaluate(storage, on).run_requests
    assert [r.tags["batch_pipeline/shard"] for r in requests] == ["1/3", "2/3", "3/3"]
    assert len({r.run_key for r in requests}) == 3 and all(r.run_key.endswith(f"#shard-{i}-of-3")
                                                           for i, r in enumerate(requests, 1))
    assert requests[1].run_config == batch_run_config(input_uri=str(tmp_path / "in" / "2026-11-20" / "big.jsonl"),
                                                      shard="2/3")
    assert {r.partition_key for r in requests} == {"2026-11-20"}
    with pytest.raises(ConfigError, match="SHARDS='0' is out of range"):
        shards_from_env({"SHARDS": "0"})


def test_shard_runs_write_one_set_of_results_once_every_shard_is_done(tiny_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    ids = [f"s-{i}" for i in range(9)]
    write_date_batch(inbox / DATE, "big.jsonl", [chat_line(i) for i in ids] + ["{not json"])
    results = out / DATE / "big"

    first = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(shard="1/2"))
    assert first.success
    assert not (results / "output.jsonl").exists() and not (results / "batch.json").exists()
    assert metadata_of(first, "throughput_metrics") == {"batches": 0}
    record = json.loads((results / "_work" / "inference-shard-1-of-2.json").read_text())
    assert record["computed_requests"] == 4 and record["shard"] == "1/2"  # 9 valid lines: 4 + 5

    second = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(shard="2/2"))
    assert second.success
    outputs, errors = read_jsonl(str(results / "output.jsonl")), read_jsonl(str(results / "errors.jsonl"))
    assert sorted(o["custom_id"] for o in outputs) == sorted(ids) and len(errors) == 1
    batch = json.loads((results / "batch.json").read_text())
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 10, "completed": 9, "failed": 1}
    metrics = json.loads((results / "metrics.json").read_text())
    assert metrics["shards"] == 2 and sum(metrics["requests_per_rank"]) == 9 and metrics["resumed_requests"] == 0
    assert metadata_of(second, "throughput_metrics")["shards"] == 2

    again = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(shard="1/2"))
    assert again.success and json.loads((results / "batch.json").read_text())["id"] == batch["id"]


def test_a_shard_that_the_last_one_overtakes_while_writing_measures_nothing(tiny_llm, tmp_path, monkeypatch):
    """Two shard runs ending together: shard 1's output step finds shard 2 unfinished (so writes no
    results), then shard 2 finishes and is still writing batch.json when shard 1's throughput_metrics
    runs. Shard 1 measures nothing rather than reading a batch.json that is not there yet (the two
    `batch-pipeline run --shard` processes below failed so, now and then, on a slow machine)."""
    from batch_pipeline.defs import assets

    inbox, out = tmp_path / "in", tmp_path / "out"
    write_date_batch(inbox / DATE, "raced.jsonl", [chat_line(f"r-{i}") for i in range(4)])
    work = out / DATE / "raced" / "_work"
    write_batches = assets.write_batches

    def then_shard_2_finishes(context, taken, shard, *args, **kwargs):
        rows = write_batches(context, taken, shard, *args, **kwargs)
        own = json.loads((work / "inference-shard-1-of-2.json").read_text())  # shard 2's record: same key
        (work / "inference-shard-2-of-2.json").write_text(json.dumps({**own, "shard": "2/2"}))
        return rows

    monkeypatch.setattr(assets, "write_batches", then_shard_2_finishes)
    first = materialize(tiny_llm, str(inbox), str(out), run_config=batch_run_config(shard="1/2"))
    assert first.success, [e.message for e in first.all_events if e.is_failure]
    assert metadata_of(first, "batch_outputs")["batches"] == 0 and not (work.parent / "batch.json").exists()
    assert metadata_of(first, "throughput_metrics") == {"batches": 0}


def test_smollm2_shards_give_one_runs_answers(smollm2_llm, tmp_path):
    inbox = tmp_path / "in"
    questions = ["What is the capital of France?", "What is the capital of Germany?", "What is the capital of Japan?",
                 "What is the capital of Italy?", "What is the capital of Spain?"]
    model = smollm2_llm.generation_model()[1]
    lines = [json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                                  "temperature": 0}}) for i, q in enumerate(questions)]
    write_date_batch(inbox / DATE, "capitals.jsonl", lines)

    def answers(out: Path) -> dict[str, str]:
        return {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"]
                for o in read_jsonl(str(out / DATE / "capitals" / "output.jsonl"))}

    for shard in ("2/2", "1/2"):  # in either order
        assert materialize(smollm2_llm, str(inbox), str(tmp_path / "sharded"), run_config=batch_run_config(shard=shard)).success
    assert materialize(smollm2_llm, str(inbox), str(tmp_path / "whole")).success
    sharded = answers(tmp_path / "sharded")
    assert sharded == answers(tmp_path / "whole") and len(sharded) == 5
    assert "Paris" in sharded["c-0"] and "Berlin" in sharded["c-1"], sharded


def test_two_servers_each_running_a_shard_at_once(tiny_model_dir, tiny_llm, tmp_path):
    ids = [f"two-{i:02d}" for i in range(24)]
    batch = write_batch(tmp_path / "in.jsonl", ids, 8, temperature=0)
    out = tmp_path / "out"
    env = tiny_env(tiny_model_dir, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([str(CLI), "run", str(batch), "--output-dir", str(out), "--shard", f"{i}/2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    printed = [p.communicate(timeout=600) for p in procs]
    tails = [(out_text[-500:], "\n".join(l for l in err.splitlines() if "DEBUG" not in l)[-3000:]) for out_text, err in printed]
    assert [p.returncode for p in procs] == [0, 0], tails
    outputs, errors, result = read_results(out)
    answered_once(outputs, errors, ids)
    assert errors == [] and result["status"] == "completed"
    # The shard that finished last wrote the results; the other says so, whichever it was.
    assert any(f"results in {out}" in stdout for stdout, _ in printed), tails
    assert all(f"results in {out}" in stdout or "done; results go into" in stdout for stdout, _ in printed), tails
    assert json.loads((out / "metrics.json").read_text())["shards"] == 2

    # Greedy answers are those of one process answering the whole batch: this one, on the session's
    # tiny engine (the same run_batch as `batch-pipeline run`, without a third vLLM start).
    whole = tmp_path / "whole"
    storage = StorageResource(input_path=str(tmp_path), output_path=str(whole))
    assert run_batch(str(batch), str(whole), DATE, resources={"llm": tiny_llm, "storage": storage}).success
    one, _, _ = read_results(whole)
    choices = {o["custom_id"]: o["response"]["body"]["choices"] for o in one}
    assert {o["custom_id"]: o["response"]["body"]["choices"] for o in outputs} == choices

    bad = subprocess.run([str(CLI), "run", str(batch), "--output-dir", str(out), "--shard", "3/2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "shard 3/2 does not exist" in bad.stderr
    assert os.path.exists(out / "output.jsonl")

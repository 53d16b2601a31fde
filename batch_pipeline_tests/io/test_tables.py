"""Results as tables: each batch's results.parquet and each date's metrics.parquet, read back with pandas.

Covers: the row built from every kind of result line (chat, completion, embeddings, a validation
error, an engine refusal, a cancelled line); a JSONL batch run through the Dagster assets on the tiny
model (real vLLM), whose results.parquet matches output.jsonl and errors.jsonl line for line, in
input order, with the explicit schema; batch_outputs' column schema and preview; the date's
metrics.parquet against the throughput figures. Table inputs: a Parquet file (carried-through columns
keep their types, error rows name the row and the column, custom_id defaults to the row number), a CSV
with a messages column and a column name that collides with a result column, a table file found by the
upload sensor on the S3 server and answered from S3, and (marked smollm2) real answers through the
CLI's run_batch. Peak memory on a 1M-row file: bench/table_inputs.py.
"""

from __future__ import annotations

import json

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.resources import BatchSelection, StorageResource
from batch_pipeline.io import table_inputs, tables
from batch_pipeline_tests.support.asset_runs import DATE, chat_line, materialize, metadata_of, read_jsonl, write_batch
from batch_pipeline_tests.support import TINY_NAME
from batch_pipeline_tests.support.sensor_ticks import evaluate, turned_on


def test_rows_of_every_kind_of_result_line():
    chat = {"custom_id": "c", "error": None, "response": {"status_code": 200, "body": {
        "object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}}}
    text = {"custom_id": "t", "error": None, "response": {"status_code": 200, "body": {
        "object": "text_completion", "choices": [{"text": "abc", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5}}}}
    emb = {"custom_id": "e", "error": None, "response": {"status_code": 200, "body": {
        "object": "list", "data": [{"embedding": [0.1]}], "usage": {"prompt_tokens": 4, "total_tokens": 4}}}}
    invalid = {"custom_id": None, "response": None, "error": {"code": "invalid_json", "message": "line 3: bad", "line": 3}}
    refused = {"custom_id": "r", "error": None, "response": {"status_code": 400, "body": {
        "error": {"message": "too long", "type": "invalid_request_error", "param": None, "code": None}}}}
    cancelled = {"custom_id": "x", "response": None, "error": {"code": "batch_cancelled", "message": "cancelled"}}
    rows = {r["custom_id"]: r for r in (tables.result_row(i, rec) for i, rec in
                                         enumerate([chat, text, emb, invalid, refused, cancelled], 1))}
    assert rows["c"] | {} == {"line": 1, "custom_id": "c", "status": "completed", "content": "hi", "reasoning": None, "finish_reason": "stop",
                             "prompt_tokens": 7, "completion_tokens": 2, "error_code": None, "error_message": None,
                             "tool_calls": None}
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    called = tables.result_row(7, {"custom_id": "f", "error": None, "response": {"status_code": 200, "body": {
        "object": "chat.completion", "usage": {},
        "choices": [{"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}]}}})
    assert (called["content"], called["finish_reason"], json.loads(called["tool_calls"])) == (None, "tool_calls", calls)
    assert (rows["t"]["content"], rows["t"]["finish_reason"], rows["t"]["completion_tokens"]) == ("abc", "length", 5)
    assert (rows["e"]["status"], rows["e"]["content"], rows["e"]["prompt_tokens"]) == ("completed", None, 4)
    assert (rows[None]["status"], rows[None]["error_code"], rows[None]["line"]) == ("failed", "invalid_json", 4)
    assert (rows["r"]["status"], rows["r"]["error_code"], rows["r"]["error_message"]) == (
        "failed", "invalid_request_error", "too long")
    assert (rows["x"]["status"], rows["x"]["error_code"]) == ("cancelled", "batch_cancelled")


def test_results_parquet_matches_the_jsonl_results_line_for_line(tiny_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    lines = [chat_line(f"q-{i}", content=f"say {i}") for i in range(6)]
    lines.insert(2, "{broken")
    lines.insert(5, chat_line("q-1"))  # a duplicate custom_id
    write_batch(inbox / DATE, "mixed.jsonl", lines)
    write_batch(inbox / DATE, "second.jsonl", [chat_line("s-1")])
    result = materialize(tiny_llm, str(inbox), str(out))
    assert result.success

    folder = out / DATE / "mixed"
    frame = pd.read_parquet(folder / "results.parquet")
    assert pq.read_schema(folder / "results.parquet").remove_metadata() == tables.RESULTS_SCHEMA
    assert list(frame["line"]) == list(range(1, 9))  # every input line once, in input order
    assert str(frame["prompt_tokens"].dtype) == "int64" and str(frame["completion_tokens"].dtype) == "int64"
    outputs = {o["custom_id"]: o for o in read_jsonl(str(folder / "output.jsonl"))}
    errors = {e["error"]["line"]: e for e in read_jsonl(str(folder / "errors.jsonl")) if e["error"]}
    assert len(outputs) + len(errors) == len(frame) == 8
    for row in frame.to_dict("records"):
        if row["status"] == "completed":
            body = outputs[row["custom_id"]]["response"]["body"]
            assert row["content"] == body["choices"][0]["message"]["content"]
            assert row["finish_reason"] == body["choices"][0]["finish_reason"]
            assert (row["prompt_tokens"], row["completion_tokens"]) == (
                body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
            assert pd.isna(row["error_code"])
        else:
            error = errors[row["line"]]["error"]
            assert row["status"] == "failed" and (row["error_code"], row["error_message"]) == (error["code"], error["message"])
            assert pd.isna(row["content"]) and row["prompt_tokens"] == 0
    assert list(frame.loc[frame["status"] == "failed", "error_code"]) == ["invalid_json", "duplicate_custom_id"]

    outputs_meta = next(e for e in result.get_asset_materialization_events()
                        if e.asset_key.to_user_string() == "batch_outputs").materialization.metadata
    schema = outputs_meta["dagster/column_schema"].value
    assert [c.name for c in schema.columns] == [f.name for f in tables.RESULTS_SCHEMA]
    preview = outputs_meta["results_preview"].value
    assert [r.data["line"] for r in preview.records] == [1, 2, 3, 4, 5]
    assert "content" not in preview.records[0].data and "error_message" not in preview.records[0].data  # no text

    # The date's figures as one table: a row per batch, adding up to throughput_metrics.
    figures = metadata_of(result, "throughput_metrics")
    daily = pd.read_parquet(out / DATE / "metrics.parquet")
    assert sorted(daily["batch"]) == ["mixed", "second"]
    assert daily["requests_completed"].sum() == figures["requests_completed"] == 7
    assert daily["output_tokens"].sum() == figures["output_tokens"]
    assert figures["metrics_table"] == str(out / DATE / "metrics.parquet")
    assert json.loads((folder / "metrics.json").read_text())["requests_total"] == 8


# ---------------------------------------------------------------------------------- table inputs


def catalogue(path, rows: int = 6) -> None:
    """A product table: prompt + system, per-row max_tokens/temperature, carried-through columns;
    row 3 has no prompt, row 5 a max_tokens that is not a number, row 6 no custom_id."""
    table = pa.table({
        "custom_id": [f"p-{i}" for i in range(1, rows)] + [None],
        "prompt": [f"Describe product {i}" if i != 3 else None for i in range(1, rows + 1)],
        "system": ["Be brief."] * rows,
        "max_tokens": ["3", "4", "3", "3", "ten", None],
        "temperature": [0.0] * rows,
        "product_id": pa.array(range(100, 100 + rows), pa.int64()),
        "price": [9.5 + i for i in range(rows)],
        "tags": [["a", "b"]] * rows,
    })
    pq.write_table(table, path, row_group_size=4)


def test_parquet_rows_become_requests_and_come_back_with_their_columns(tiny_llm, tmp_path, monkeypatch):
    monkeypatch.setattr(table_inputs, "READ_ROWS", 4)  # several record batches, not aligned with the row groups
    monkeypatch.setattr(tables, "ROW_GROUP_ROWS", 5)
    inbox, out = tmp_path / "in", tmp_path / "out"
    (inbox / DATE).mkdir(parents=True)
    catalogue(inbox / DATE / "catalogue.parquet")
    result = materialize(tiny_llm, str(inbox), str(out))
    assert result.success
    folder = out / DATE / "catalogue"
    frame = pd.read_parquet(folder / "results.parquet")
    assert list(frame["line"]) == [1, 2, 3, 4, 5, 6]
    assert list(frame["product_id"]) == list(range(100, 106)) and str(frame["product_id"].dtype) == "int64"
    assert list(frame["price"]) == [9.5 + i for i in range(6)] and list(frame["tags"].iloc[0]) == ["a", "b"]
    assert list(frame["custom_id"]) == ["p-1", "p-2", "p-3", "p-4", "p-5", "6"]  # the row number when missing
    assert list(frame["status"]) == ["completed", "completed", "failed", "completed", "failed", "completed"]
    assert frame.loc[2, "error_message"] == "row 3: column `prompt` is empty"
    assert frame.loc[4, "error_message"] == "row 5: column `max_tokens` must be an integer, got 'ten'"
    assert set(frame.loc[[2, 4], "error_code"]) == {"invalid_request"}
    assert (frame.loc[[0, 1, 3], "completion_tokens"] <= [3, 4, 3]).all()  # per-row max_tokens honoured
    assert frame.loc[5, "completion_tokens"] > 4  # blank: the model's default
    # The JSONL results hold the same answers; the request lines were OpenAI chat requests.
    outputs = {o["custom_id"]: o for o in read_jsonl(str(folder / "output.jsonl"))}
    assert set(outputs) == {"p-1", "p-2", "p-4", "6"}
    assert outputs["p-2"]["response"]["body"]["usage"]["completion_tokens"] <= 4
    errors = read_jsonl(str(folder / "errors.jsonl"))
    assert sorted(e["error"]["line"] for e in errors) == [3, 5] and {e["custom_id"] for e in errors} == {"p-3", "p-5"}
    batch = json.loads((folder / "batch.json").read_text())
    assert batch["request_counts"] == {"total": 6, "completed": 4, "failed": 2}
    assert batch["metadata"]["input_sha256"]


def test_csv_with_messages_and_a_colliding_column(tiny_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    (inbox / DATE).mkdir(parents=True)
    conversation = json.dumps([{"role": "system", "content": "Answer."}, {"role": "user", "content": "hi"}])
    frame = pd.DataFrame({
        "messages": [conversation, "not json", conversation],
        "model": [TINY_NAME, TINY_NAME, "no-such-model"],
        "max_tokens": [2, 2, 2],
        "status": ["new", "old", "new"],  # a column named like a result column
        "note": ["x", None, "z"],
    })
    frame.to_csv(inbox / DATE / "chats.csv", index=False)
    assert materialize(tiny_llm, str(inbox), str(out)).success
    results = pd.read_parquet(out / DATE / "chats" / "results.parquet")
    assert list(results["status"]) == ["completed", "failed", "failed"]
    assert list(results["input_status"]) == ["new", "old", "new"]  # carried through under another name
    assert results.loc[0, "note"] == "x" and pd.isna(results.loc[1, "note"])
    assert results.loc[1, "error_message"] == "row 2: column `messages` is not a JSON list of {role, content}"
    assert results.loc[2, "error_code"] == "model_not_found"
    assert list(results["custom_id"]) == ["1", "2", "3"]


def test_a_table_on_s3_is_found_by_the_sensor_and_answered(tiny_llm, s3_bucket, moto_server, monkeypatch):
    monkeypatch.setenv("SENSOR_WINDOW_DAYS", "all")  # DATE is fixed; the default window follows today

    storage = StorageResource(input_path=f"s3://{s3_bucket}/incoming", output_path=f"s3://{s3_bucket}/output")
    on = turned_on(storage)
    client = moto_server.client()
    frame = pd.DataFrame({"prompt": ["hello", "world"], "row_ref": [7, 8], "max_tokens": [2, 2]})
    client.put_object(Bucket=s3_bucket, Key=f"incoming/{DATE}/rows.parquet", Body=frame.to_parquet(index=False))
    client.put_object(Bucket=s3_bucket, Key=f"incoming/{DATE}/sheet.csv", Body=b"prompt,max_tokens,owner\nhey,2,ann\n")
    client.put_object(Bucket=s3_bucket, Key=f"incoming/{DATE}/notes.txt", Body=b"not a batch")
    requests = evaluate(storage, on).run_requests  # one run per table; the text file is no batch
    assert sorted(r.partition_key for r in requests) == [f"{DATE}/rows", f"{DATE}/sheet"]
    assert sorted(r.tags["batch_pipeline/batch_name"] for r in requests) == ["rows", "sheet"]
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("batch_files", [r.partition_key for r in requests])
    for request in requests:
        result = dg.materialize(
            [batch_files], partition_key=request.partition_key, run_config=request.run_config or None,
            raise_on_error=False, instance=instance,
            resources={"batch": BatchSelection(), "llm": tiny_llm, "storage": storage},
        )
        assert result.success, request.partition_key
    body = client.get_object(Bucket=s3_bucket, Key=f"output/{DATE}/rows/results.parquet")["Body"].read()
    results = pq.read_table(pa.BufferReader(body)).to_pandas()
    assert list(results["row_ref"]) == [7, 8] and list(results["status"]) == ["completed", "completed"]
    body = client.get_object(Bucket=s3_bucket, Key=f"output/{DATE}/sheet/results.parquet")["Body"].read()
    sheet = pq.read_table(pa.BufferReader(body)).to_pandas()
    assert list(sheet["owner"]) == ["ann"] and list(sheet["status"]) == ["completed"]


@pytest.mark.smollm2
def test_real_answers_from_tables_through_the_cli(smollm2_llm, tmp_path):
    from batch_pipeline.defs.jobs import run_batch

    questions = pd.DataFrame({
        "custom_id": ["fr", "de"],
        "prompt": ["What is the capital of France?", "What is the capital of Germany?"],
        "max_tokens": [24, 24], "temperature": [0.0, 0.0], "country_code": ["FR", "DE"],
    })
    source = tmp_path / "capitals.parquet"
    questions.to_parquet(source, index=False)
    out = tmp_path / "out"
    result = run_batch(str(source), str(out), DATE, resources={
        "batch": BatchSelection(), "llm": smollm2_llm,
        "storage": StorageResource(input_path=str(tmp_path), output_path=str(out))})
    assert result.success
    results = pd.read_parquet(out / "results.parquet").set_index("custom_id")
    assert "Paris" in results.loc["fr", "content"] and "Berlin" in results.loc["de", "content"]
    assert list(results["country_code"]) == ["FR", "DE"]
    sheet = tmp_path / "capitals.csv"
    sheet.write_text('custom_id,prompt,max_tokens,temperature,note\nfr,"What is the capital of France?",24,0,x\n')
    result = run_batch(str(sheet), str(tmp_path / "out-csv"), DATE, resources={
        "batch": BatchSelection(), "llm": smollm2_llm,
        "storage": StorageResource(input_path=str(tmp_path), output_path=str(tmp_path / "out-csv"))})
    assert result.success
    row = pd.read_parquet(tmp_path / "out-csv" / "results.parquet").iloc[0]
    assert "Paris" in row["content"] and row["note"] == "x"


def test_row_conversion_names_row_and_column():
    ok = json.loads(table_inputs.request_line({"prompt": "hi", "max_tokens": 3.0, "temperature": "0.5"}, 4, "m"))
    assert ok == {"custom_id": "4", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.5}}
    for row, message in [
        ({"custom_id": "x"}, "row 2: no `prompt` or `messages` column in the file"),
        ({"prompt": 5}, "row 2: column `prompt` must be text, got int '5'"),
        ({"prompt": "a", "max_tokens": 2.5}, "row 2: column `max_tokens` must be an integer, got '2.5'"),
        ({"prompt": "a", "temperature": "warm"}, "row 2: column `temperature` must be a number, got 'warm'"),
        ({"messages": []}, "row 2: column `messages` must be a non-empty list of {role, content}"),
    ]:
        with pytest.raises(table_inputs.RowError) as caught:
            table_inputs.request_line(row, 2, "m")
        assert str(caught.value) == message


def test_a_file_that_is_not_a_table_fails_as_a_batch_not_as_a_run(tiny_llm, tmp_path):
    inbox, out = tmp_path / "in", tmp_path / "out"
    (inbox / DATE).mkdir(parents=True)
    (inbox / DATE / "truncated.parquet").write_bytes(b"PAR1 this is not really parquet")
    result = materialize(tiny_llm, str(inbox), str(out))
    assert not result.success  # a file-level error turns the run red, as for JSONL...
    [failure] = [e for e in result.all_events if e.is_step_failure]
    assert failure.step_key == "batch_outputs"  # ...once its files are written, not by a crash in validation
    batch = json.loads((out / DATE / "truncated" / "batch.json").read_text())
    assert batch["status"] == "failed"
    [error] = batch["errors"]["data"]
    assert error["code"] == "unreadable_file" and error["message"].startswith("truncated.parquet cannot be read as Parquet: ")

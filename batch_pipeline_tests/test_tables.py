"""Results as tables: each batch's results.parquet and each date's metrics.parquet, read back with pandas.

Covers: the row built from every kind of result line (chat, completion, embeddings, a validation
error, an engine refusal, a cancelled line); a JSONL batch run through the Dagster assets on the tiny
model (real vLLM), whose results.parquet matches output.jsonl and errors.jsonl line for line, in
input order, with the explicit schema; batch_outputs' column schema and preview; the date's
metrics.parquet against the throughput figures. Does not cover Parquet/CSV inputs (not built yet).
"""

from __future__ import annotations

import json

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq

from batch_pipeline.lib import tables
from batch_pipeline_tests.test_assets import DATE, chat_line, materialize, metadata_of, read_jsonl, write_batch


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
    assert rows["c"] | {} == {"line": 1, "custom_id": "c", "status": "completed", "content": "hi", "finish_reason": "stop",
                             "prompt_tokens": 7, "completion_tokens": 2, "error_code": None, "error_message": None}
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

    # The date's figures as one table: a row per batch, adding up to throughput_metrics.
    figures = metadata_of(result, "throughput_metrics")
    daily = pd.read_parquet(out / DATE / "metrics.parquet")
    assert sorted(daily["batch"]) == ["mixed", "second"]
    assert daily["requests_completed"].sum() == figures["requests_completed"] == 7
    assert daily["output_tokens"].sum() == figures["output_tokens"]
    assert figures["metrics_table"] == str(out / DATE / "metrics.parquet")
    assert json.loads((folder / "metrics.json").read_text())["requests_total"] == 8

"""The four assets materialized in-process (`dg.materialize`) over batch files a test writes.

Holds the date the tests' files are filed under (DATE), a chat line on the tiny model
(`chat_line`), a batch file in a date folder (`write_batch`), a run of BATCH_ASSETS for one
partition on a given LLM resource and storage roots (`materialize`), a result file's records
(`read_jsonl`) and an asset's materialization metadata (`metadata_of`). Used by test_assets.py and
the tests that run the assets for one feature (test_batch_files.py, test_lora.py,
test_models_file.py, test_reasoning.py, test_responses_api.py, test_scoring.py, test_shards.py,
test_tables.py, test_tool_calls.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from batch_pipeline.defs.assets import BATCH_ASSETS
from batch_pipeline.defs.resources import BatchSelection, StorageResource
from batch_pipeline.io import storage
from batch_pipeline_tests.support.cli_runs import jsonl_records
from batch_pipeline_tests.support import TINY_NAME

DATE = "2026-11-29"


def chat_line(custom_id: str, content: str = "hello", **body) -> str:
    payload = {"model": TINY_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": payload})


def write_batch(folder: Path, name: str, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def materialize(llm, input_root: str, output_root: str, partition: str = DATE, run_config=None, instance=None):
    return dg.materialize(
        BATCH_ASSETS,
        partition_key=partition,
        resources={"batch": BatchSelection(), "llm": llm, "storage": StorageResource(input_path=input_root, output_path=output_root)},
        run_config=run_config,
        instance=instance or dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def read_jsonl(uri: str) -> list[dict]:
    return jsonl_records(storage.read_text(uri))


def metadata_of(result, asset: str) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return {k: v.value for k, v in event.materialization.metadata.items()}

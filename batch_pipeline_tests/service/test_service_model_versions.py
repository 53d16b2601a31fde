"""A switch and a rollback of a model's version while Batch API batches wait: only new batches move.

`batch-pipeline serve` over a real `dagster dev` (its daemon, the queued run coordinator, run
workers on the tiny model), MODELS_FILE giving `summ` two versions (two folders of the tiny model,
each with its weight checksums), the alias switched with the real `batch-pipeline model` command
between creates.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.config.model_versions import checksums_of
from batch_pipeline_tests.support.api_service import RUN_TIMEOUT, client, serve_env, service_stack, upload
from batch_pipeline_tests.support import wait_for

KEY = "key-versions-0123456789"
TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("versions")
    second = root / "tiny-v2"
    shutil.copytree(tiny_model_dir, second)
    models_file = root / "models.yaml"
    models_file.write_text("summ:\n  max_model_len: 512\n  versions:\n"
                           f"    v1: {{path: {tiny_model_dir}, sha256: {json.dumps(checksums_of(tiny_model_dir))}}}\n"
                           f"    v2: {{path: {second}, sha256: {json.dumps(checksums_of(second))}}}\n"
                           "  current: v1\n")
    with service_stack(root, tiny_model_dir, {"BATCH_API_KEYS": f"team:{KEY}"},
                       pipeline_extra={"MODELS_FILE": str(models_file)}) as s:
        yield s


def model_command(stack: Any, *args: str) -> str:
    proc = subprocess.run([str(Path(sys.executable).with_name("batch-pipeline")), "model", *args], capture_output=True,
                          text=True, env=serve_env(stack["env"]), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def line(custom_id: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}], "max_tokens": 4,
            "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_a_switch_and_a_rollback_mid_queue_change_only_batches_created_after_them(stack):
    sdk = client(stack["url"], KEY)
    created: dict[str, Any] = {}
    created["before"] = sdk.batches.create(input_file_id=upload(sdk, [line("a", "summ")]).id,
                                           endpoint="/v1/chat/completions", completion_window="24h")
    assert "summ: new batches use v2 (was v1)" in model_command(stack, "use", "summ@v2")
    switched_at = time.time()
    created["after_switch"] = sdk.batches.create(input_file_id=upload(sdk, [line("b", "summ")]).id,
                                                 endpoint="/v1/chat/completions", completion_window="24h")
    said = model_command(stack, "rollback", "summ")
    assert "rolled back from v2 to v1" in said
    created["after_rollback"] = sdk.batches.create(input_file_id=upload(sdk, [line("c", "summ"), line("d", "summ@v2")]).id,
                                                   endpoint="/v1/chat/completions", completion_window="24h")
    # Pinned at create, shown at once on the Batch object (the SDK keeps metadata as strings).
    assert {k: b.metadata.get("model_versions") for k, b in created.items()} == {
        "before": "summ=v1", "after_switch": "summ=v2", "after_rollback": "summ=v1"}

    done = {}
    for name, batch in created.items():
        done[name] = wait_for(f"batch {name} finished",
                              lambda b=batch: (r := sdk.batches.retrieve(b.id)).status in TERMINAL and r,
                              RUN_TIMEOUT, interval=1.0, on_timeout=stack["server"].log_tail)
        assert done[name].status == "completed", (name, done[name])
    # The first batch waited in the queue past the switch and still answered with the version it was
    # created under: its answering began after the switch.
    assert done["before"].in_progress_at >= int(switched_at), (done["before"].in_progress_at, switched_at)

    def models(batch: Any) -> dict[str, str]:
        text = sdk.files.content(batch.output_file_id).text
        return {o["custom_id"]: o["response"]["body"]["model"] for o in map(json.loads, text.splitlines())}

    assert models(done["before"]) == {"a": "summ@v1"}
    assert models(done["after_switch"]) == {"b": "summ@v2"}
    assert models(done["after_rollback"]) == {"c": "summ@v1", "d": "summ@v2"}  # an explicit version wins
    assert done["after_switch"].metadata["model_versions"] == "summ=v2"
    listed = model_command(stack, "list")
    assert "summ@v1" in listed and "new batches" in listed.split("summ@v1")[1].splitlines()[0]

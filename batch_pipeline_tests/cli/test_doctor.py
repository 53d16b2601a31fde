"""Tests for batch_pipeline.cli.doctor: the pre-flight checks behind `batch-pipeline doctor`.

Covers: every check passing on a working local setup (the installed CPU engine really imported, the
tiny test model, storage folders in tmp_path, a SQLite Dagster instance), the report format, and
clear failures: an unwritable output path, an unreachable S3 endpoint (real boto3 against a closed
port), a model folder missing its config, tokenizer or a weight shard or differing from its build
marker, a setting that does not parse, a missing DAGSTER_HOME. S3 with server-side encryption passes
against moto's server over HTTP, and the probe object is gone afterwards.

Does not load a model into vLLM, touch real AWS or ~/.aws, or need a GPU (on this CPU build "no GPU"
is a pass with a note). PostgreSQL instance checks are in test_postgres.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batch_pipeline.cli import doctor
from batch_pipeline.io import storage
from batch_pipeline_tests.support import REPO
from batch_pipeline_tests.support.s3_server import MotoS3
from batch_pipeline_tests.support.sqs_queue import notifying_queue, sqs_client

ENGINE_VARS = (
    "MODEL_PATH",
    "SERVED_MODEL_NAME",
    "TENSOR_PARALLEL_SIZE",
    "EMBEDDING_MODEL_PATH",
    "MAX_MODEL_LEN",
    "CHECKPOINT_ANSWERS",
    "SHARD_SIZE",
    "ENGINE_PRESET",
    "CHECKPOINT_SECONDS",
    "DTYPE",
)
AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS", "S3_SSE", "S3_SSE_KMS_KEY_ID")


@pytest.fixture
def local_setup(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working machine: model, input and output folders, a SQLite instance from ../dagster.yaml."""
    for var in ENGINE_VARS + AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "in" / "2024-06-01").mkdir(parents=True)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("MODEL_PATH", str(tiny_model_dir))
    monkeypatch.setenv("STORAGE_INPUT_PATH", str(tmp_path / "in"))
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(tmp_path / "out"))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    yield tmp_path
    storage.reset_clients()


def by_name(results: list[doctor.CheckResult]) -> dict[str, doctor.CheckResult]:
    return {r.name: r for r in results}


def test_every_check_passes_on_a_working_local_setup(local_setup: Path):
    results = doctor.run_checks()
    assert [r.name for r in results] == list(doctor.CHECKS)
    failing = {r.name: r.detail for r in results if r.status != "PASS"}
    assert not failing
    checks = by_name(results)
    assert checks["engine"].detail.startswith("vllm")
    assert "no GPU (CPU build" in checks["gpu"].detail
    assert "config.json sha256" in checks["model"].detail
    assert "matches its build marker" in checks["model"].detail
    assert "SqliteRunStorage" in checks["dagster instance"].detail
    # The probe is gone; nothing else was written.
    assert [p.name for p in (local_setup / "out").iterdir()] == []
    assert doctor.all_ok(results)


def test_report_has_one_status_line_per_check():
    results = [
        doctor.CheckResult("engine", True, "vllm 0.33.0"),
        doctor.CheckResult("embedding model", True, "none", warning=True),
        doctor.CheckResult("storage output", False, "cannot write"),
    ]
    lines = doctor.format_report(results).splitlines()
    assert lines == [
        "PASS  engine           vllm 0.33.0",
        "WARN  embedding model  none",
        "FAIL  storage output   cannot write",
    ]
    assert not doctor.all_ok(results)
    assert doctor.all_ok(results[:2])


def test_unknown_check_name_is_refused():
    with pytest.raises(ValueError, match="unknown checks: nope"):
        doctor.run_checks(only=["nope"])


def test_unwritable_output_path_fails_clearly(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    # A path below a regular file cannot be created, whoever runs the test (root ignores modes).
    blocker = local_setup / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(blocker / "out"))
    (result,) = doctor.run_checks(only=["storage output"])
    assert result.status == "FAIL"
    assert result.detail.startswith(f"cannot write under {blocker / 'out'}: ")
    assert "Error" in result.detail  # the OS error's class: NotADirectoryError / FileExistsError


def test_missing_input_folder_fails_clearly(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("STORAGE_INPUT_PATH", str(local_setup / "nowhere"))
    (result,) = doctor.run_checks(only=["storage input"])
    assert result.status == "FAIL"
    assert result.detail == f"{local_setup / 'nowhere'} is not a folder"


def test_unreachable_s3_endpoint_fails_clearly(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    for name, value in {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "STORAGE_INPUT_PATH": "s3://batches/input",
        "STORAGE_OUTPUT_PATH": "s3://batches/output",
    }.items():
        monkeypatch.setenv(name, value)
    results = by_name(doctor.run_checks(only=["storage input", "storage output"]))
    for name, prefix in (("storage input", "cannot list s3://batches/input"), ("storage output", "cannot write under s3://batches/output")):
        assert results[name].status == "FAIL"
        assert results[name].detail.startswith(prefix), results[name].detail
        assert "EndpointConnectionError" in results[name].detail
        assert "http://127.0.0.1:9" in results[name].detail


def test_s3_with_server_side_encryption_passes(
    local_setup: Path, s3_bucket: str, moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("STORAGE_INPUT_PATH", f"s3://{s3_bucket}/input")
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", f"s3://{s3_bucket}/output")
    monkeypatch.setenv("S3_SSE", "AES256")
    results = by_name(doctor.run_checks(only=["storage input", "storage output"]))
    assert results["storage input"].status == "PASS", results["storage input"].detail
    assert results["storage output"].status == "PASS", results["storage output"].detail
    assert "encrypted AES256" in results["storage output"].detail
    assert moto_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0


def _break_missing_config(folder: Path) -> str:
    (folder / "config.json").unlink()
    return "has no config.json"


def _break_missing_tokenizer(folder: Path) -> str:
    (folder / "tokenizer.json").unlink()
    return "has no tokenizer"


def _break_missing_shard(folder: Path) -> str:
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return "weight shards missing: model-00002-of-00002.safetensors"


def _break_changed_file(folder: Path) -> str:
    with open(folder / "config.json", "a") as f:
        f.write("\n")
    return "differs from its build marker (config.json is"


@pytest.mark.parametrize(
    "damage", [_break_missing_config, _break_missing_tokenizer, _break_missing_shard, _break_changed_file]
)
def test_incomplete_model_folder_fails_clearly(
    local_setup: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, damage
):
    folder = local_setup / "model"
    shutil.copytree(tiny_model_dir, folder)
    expected = damage(folder)
    monkeypatch.setenv("MODEL_PATH", str(folder))
    (result,) = doctor.run_checks(only=["model"])
    assert result.status == "FAIL"
    assert expected in result.detail, result.detail
    assert str(folder) in result.detail


def test_unmounted_model_fails_and_unbuilt_bundled_model_warns(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MODEL_PATH", str(local_setup / "not-mounted"))
    (result,) = doctor.run_checks(only=["model"])
    assert result.status == "FAIL" and "is not a folder" in result.detail

    monkeypatch.delenv("MODEL_PATH")
    monkeypatch.setenv("BATCH_PIPELINE_CACHE", str(local_setup / "empty-cache"))
    (result,) = doctor.run_checks(only=["model"])
    assert result.status == "WARN" and "batch-pipeline model prepare" in result.detail


def test_setting_that_does_not_parse_fails_naming_it(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TENSOR_PARALLEL_SIZE", "two")
    results = by_name(doctor.run_checks(only=["settings", "model"]))
    assert results["settings"].status == "FAIL"
    assert "TENSOR_PARALLEL_SIZE='two'" in results["settings"].detail
    assert results["model"].status == "FAIL"


def test_missing_dagster_home_warns(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DAGSTER_HOME")
    (result,) = doctor.run_checks(only=["dagster instance"])
    assert result.status == "WARN"
    assert "DAGSTER_HOME is not set" in result.detail


def test_probe_that_cannot_be_deleted_is_a_warning(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    # Runs never delete, so a write-only location still works; the leftover probe is reported.
    def refuse(uri: str) -> None:
        raise storage.StorageError(uri, "AccessDenied", "not allowed", "delete")

    monkeypatch.setattr(storage, "delete", refuse)
    (result,) = doctor.run_checks(only=["storage output"])
    assert result.status == "WARN"
    assert "the probe stays: cannot delete" in result.detail and "AccessDenied" in result.detail


def test_gpu_preset_on_a_machine_without_gpus_fails_naming_it(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    """Defect: ENGINE_PRESET=h100-8b on these CPUs printed PASS for settings and the GPU check."""
    monkeypatch.setenv("ENGINE_PRESET", "h100-8b")
    [gpu] = doctor.run_checks(only=["gpu"])
    assert gpu.status == "FAIL"
    assert "ENGINE_PRESET=h100-8b is for 1 x H100 80 GB, but no GPU is visible" in gpu.detail
    [settings] = doctor.run_checks(only=["settings"])
    assert "ENGINE_PRESET=h100-8b" in settings.detail


def test_upload_sensor_check_with_and_without_the_queue(
    local_setup: Path, s3_bucket: str, moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch
):
    """Listing: the window it lists. Queue: passes when the bucket notifies it, warns when nothing
    does, fails for a queue that does not answer or a local input folder; a bad SENSOR_* fails."""
    for name in ("SENSOR_WINDOW_DAYS", "SENSOR_BACKLOG", "SENSOR_MAX_RUNS_PER_TICK", "INPUT_QUEUE_URL", "SHARDS"):
        monkeypatch.delenv(name, raising=False)
    check = lambda: doctor.run_checks(only=["upload sensor"])[0]  # noqa: E731
    assert check().status == "PASS" and "date folders of the last 3 day(s)" in check().detail

    monkeypatch.setenv("SENSOR_BACKLOG", "maybe")
    assert check().status == "FAIL" and "SENSOR_BACKLOG='maybe'" in check().detail
    monkeypatch.delenv("SENSOR_BACKLOG")

    url = notifying_queue(moto_server, s3_bucket)
    monkeypatch.setenv("INPUT_QUEUE_URL", url)
    assert check().status == "FAIL" and "is not on S3" in check().detail  # the input is still local

    monkeypatch.setenv("STORAGE_INPUT_PATH", f"s3://{s3_bucket}/incoming")
    result = check()
    assert result.status == "PASS", result.detail
    assert f"which {s3_bucket} notifies on ObjectCreated" in result.detail

    unnotified = sqs_client(moto_server).create_queue(QueueName="nobody-sends-here")["QueueUrl"]
    monkeypatch.setenv("INPUT_QUEUE_URL", unnotified)
    result = check()
    assert result.status == "WARN" and f"{s3_bucket} has no ObjectCreated notification" in result.detail

    monkeypatch.setenv("INPUT_QUEUE_URL", f"{moto_server.endpoint_url}/123456789012/no-such-queue")
    result = check()
    assert result.status == "FAIL" and "does not answer" in result.detail
    storage.reset_clients()


def test_score_model_and_reasoning_parser_are_checked(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "PASS" and "the embedding model" in result.detail
    monkeypatch.setenv("REASONING_PARSER", "no_such_parser")
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "FAIL" and "REASONING_PARSER='no_such_parser'" in result.detail and "deepseek_r1" in result.detail
    monkeypatch.setenv("REASONING_PARSER", "deepseek_r1")
    monkeypatch.setenv("SCORE_MODEL_PATH", str(local_setup / "no-model"))
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "FAIL" and result.detail == f"SCORE_MODEL_PATH={local_setup / 'no-model'} has no config.json"
    (local_setup / "no-model").mkdir()
    (local_setup / "no-model" / "config.json").write_text("{}")
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "PASS" and "no-model (SCORE_MODEL_PATH=" in result.detail and "REASONING_PARSER=deepseek_r1" in result.detail


def test_tool_call_parser_is_checked(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOOL_CALL_PARSER", "no_such_parser")
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "FAIL" and "TOOL_CALL_PARSER='no_such_parser'" in result.detail and "hermes" in result.detail
    monkeypatch.setenv("TOOL_CALL_PARSER", "hermes")
    (result,) = doctor.run_checks(only=["score and reasoning"])
    assert result.status == "PASS" and "TOOL_CALL_PARSER=hermes" in result.detail


def test_lora_adapters_are_listed_and_checked(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    (result,) = doctor.run_checks(only=["lora adapters"])
    assert result.status == "PASS" and result.detail.startswith("none")
    adapter = local_setup / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 16, "peft_type": "LORA"}')
    monkeypatch.setenv("LORA_MODULES", f"support-bot={adapter} legal={local_setup / 'missing'}")
    (result,) = doctor.run_checks(only=["lora adapters"])
    assert result.status == "FAIL" and f"legal={local_setup / 'missing'} is not a LoRA adapter folder" in result.detail
    monkeypatch.setenv("LORA_MODULES", f"support-bot={adapter}")
    (result,) = doctor.run_checks(only=["lora adapters"])
    assert result.status == "PASS" and f"support-bot (rank 16, {adapter})" in result.detail


def test_models_file_is_listed_and_checked(local_setup: Path, monkeypatch: pytest.MonkeyPatch):
    model = local_setup / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    models = local_setup / "models.yaml"
    models.write_text(f"small: {model}\nbig:\n  path: {local_setup / 'nowhere'}\n")
    monkeypatch.setenv("MODELS_FILE", str(models))
    (result,) = doctor.run_checks(only=["models file"])
    assert result.status == "FAIL" and result.detail == f"no config.json in the folder of big ({local_setup / 'nowhere'})"
    models.write_text(f"small: {model}\n")
    (result,) = doctor.run_checks(only=["models file"])
    assert result.status == "PASS" and f"small ({model})" in result.detail


def test_models_file_versions_say_which_one_new_batches_use_and_which_load_unchecked(local_setup: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch):
    from batch_pipeline.config.model_versions import checksums_of
    from batch_pipeline.io import model_aliases

    model = local_setup / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    [(weights, digest)] = checksums_of(model).items()
    models = local_setup / "models.yaml"
    models.write_text(f"s:\n  versions:\n    a: {{path: {model}, sha256: {{{weights}: {digest}}}}}\n    b: {model}\n")
    monkeypatch.setenv("MODELS_FILE", str(models))
    (result,) = doctor.run_checks(only=["models file"])
    assert result.status == "WARN", result
    assert "new batches use s@b" in result.detail and "no sha256 for s@b: loaded unchecked" in result.detail
    versions = doctor.engine_settings_from_env().versioned_models()["s"]
    model_aliases.switch(doctor.storage_settings_from_env().output_path, versions, "a")
    (result,) = doctor.run_checks(only=["models file"])
    assert "new batches use s@a" in result.detail


def test_the_warm_engine_check_names_what_the_server_serves_and_its_policy(monkeypatch: pytest.MonkeyPatch):
    """ENGINE_URL unset: nothing to check. Set: the server must serve SERVED_MODEL_NAME; its scheduling
    policy shows only on /server_info (vLLM's dev mode): priority passes, fcfs fails, unseen warns."""
    from batch_pipeline_tests.support.warm_engine import StandIn

    monkeypatch.delenv("ENGINE_URL", raising=False)
    monkeypatch.setenv("SERVED_MODEL_NAME", "tiny-llama")
    assert doctor.check_warm_engine().status == "PASS" and "ENGINE_URL unset" in doctor.check_warm_engine().detail
    policy = lambda name: {"/server_info": {"vllm_config": {"scheduler_config": {"policy": name}}}}  # noqa: E731
    servers = {"hidden": StandIn(lambda n, b: None), "priority": StandIn(lambda n, b: None, pages=policy("priority")),
               "fcfs": StandIn(lambda n, b: None, pages=policy("fcfs")),
               "other": StandIn(lambda n, b: None, served=("Llama-3-8B",))}
    try:
        results = {}
        for case, server in servers.items():
            monkeypatch.setenv("ENGINE_URL", server.url)
            results[case] = doctor.check_warm_engine()
    finally:
        for server in servers.values():
            server.stop()
    assert results["priority"].status == "PASS" and "scheduling by priority" in results["priority"].detail
    assert results["hidden"].status == "WARN" and "--scheduling-policy priority" in results["hidden"].detail
    assert results["fcfs"].status == "FAIL" and "schedules fcfs" in results["fcfs"].detail
    assert results["other"].status == "FAIL" and "serves Llama-3-8B, not tiny-llama" in results["other"].detail
    monkeypatch.setenv("ENGINE_URL", "http://127.0.0.1:9")
    down = doctor.check_warm_engine()
    assert down.status == "FAIL" and "http://127.0.0.1:9 does not answer" in down.detail


def test_the_warm_engine_check_covers_the_pooling_models_engine(monkeypatch: pytest.MonkeyPatch):
    """EMBEDDING_ENGINE_URL alone: its server must serve the embedding model's name."""
    from batch_pipeline_tests.support.warm_engine import StandIn

    for var in ("ENGINE_URL", "EMBEDDING_MODEL_PATH", "EMBEDDING_SERVED_MODEL_NAME", "MODELS_FILE"):
        monkeypatch.delenv(var, raising=False)
    servers = {"right": StandIn(lambda n, b: None, served=("all-MiniLM-L6-v2",)),
               "wrong": StandIn(lambda n, b: None, served=("bge-m3",))}
    try:
        results = {}
        for case, server in servers.items():
            monkeypatch.setenv("EMBEDDING_ENGINE_URL", server.url)
            results[case] = doctor.check_warm_engine()
    finally:
        for server in servers.values():
            server.stop()
    assert results["right"].status == "WARN" and "serves all-MiniLM-L6-v2" in results["right"].detail
    assert results["wrong"].status == "FAIL" and "serves bge-m3, not all-MiniLM-L6-v2" in results["wrong"].detail

"""Configuration by environment variable (config/settings.py) and the resources that expose it.

Also each setting's own error, in base/env.py's one wording (a variable and the value given), for the
settings read outside config/settings.py too (NIGHTLY_CRON, ALERT_WEBHOOK_URL, the Batch API's), and
an engine setting as its field: the same error from the environment and from the launchpad.

Pure unit tests: no engine is built, no storage is touched.
"""

from __future__ import annotations

import dataclasses

import pytest

from batch_pipeline.base import env as env_parse
from batch_pipeline.defs.resources import LLMResource, StorageResource
from batch_pipeline.engine.engine_args import engine_kwargs
from batch_pipeline.config.settings import (
    ConfigError,
    EngineSettings,
    S3Settings,
    engine_settings_from_env,
    s3_settings_from_env,
    shards_from_env,
    storage_settings_from_env,
    validation_limits_from_env,
)
from batch_pipeline.defs.schedules import NIGHTLY_CRON, nightly_cron_from_env
from batch_pipeline.service.api_settings import file_limits, min_expiry_seconds


def test_deployment_guide_names_map_to_engine_settings():
    env = {
        "MODEL_PATH": "/models/llama", "SERVED_MODEL_NAME": "8b-instruct-model", "TENSOR_PARALLEL_SIZE": "2",
        "MAX_MODEL_LEN": "4096", "BATCH_SIZE": "128", "ENABLE_PREFIX_CACHING": "true", "DTYPE": "bfloat16",
        "GPU_MEMORY_UTILIZATION": "0.85", "MAX_NUM_BATCHED_TOKENS": "8192", "SEED": "7",
        "ENGINE_ARGS": '{"enable_chunked_prefill": true}',
    }
    s = engine_settings_from_env(env)
    assert (s.model_path, s.served_model_name, s.tensor_parallel_size, s.max_model_len, s.batch_size) == (
        "/models/llama", "8b-instruct-model", 2, 4096, 128)
    assert s.enable_prefix_caching is True and s.dtype == "bfloat16" and s.gpu_memory_utilization == 0.85
    kwargs = engine_kwargs(s, s.model_path, s.served_model_name, "generate")
    assert kwargs["max_num_seqs"] == 128 and kwargs["tensor_parallel_size"] == 2 and kwargs["max_model_len"] == 4096
    assert kwargs["enable_chunked_prefill"] is True and kwargs["seed"] == 7


@pytest.mark.parametrize(
    "env,message",
    [
        ({"TENSOR_PARALLEL_SIZE": "two"}, "TENSOR_PARALLEL_SIZE='two' is not a valid integer"),
        ({"TENSOR_PARALLEL_SIZE": "0"}, "TENSOR_PARALLEL_SIZE=0 is out of range"),
        ({"GPU_MEMORY_UTILIZATION": "1.5"}, "GPU_MEMORY_UTILIZATION=1.5 is out of range"),
        ({"ENABLE_PREFIX_CACHING": "maybe"}, "ENABLE_PREFIX_CACHING='maybe' is not a valid boolean"),
        ({"ENGINE_ARGS": "[1]"}, "ENGINE_ARGS='[1]' is not a valid JSON object"),
        ({"MAX_MODEL_LEN": "8"}, "MAX_MODEL_LEN=8 is out of range"),
        ({"CHECKPOINT_SECONDS": "0"}, "CHECKPOINT_SECONDS=0.0 is out of range .0.5 to 3600 seconds."),
        ({"CHECKPOINT_SECONDS": "soon"}, "CHECKPOINT_SECONDS='soon' is not a valid number"),
        ({"CHECKPOINT_ANSWERS": "0"}, "CHECKPOINT_ANSWERS=0 is out of range .at least 1."),
        ({"ENGINE_PRESET": "a100"}, "ENGINE_PRESET='a100' is not a preset"),
    ],
)
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine_settings_from_env(env)


def test_launchpad_values_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("SERVED_MODEL_NAME", "from-env")
    resource = LLMResource(max_model_len=2048)
    assert resource.settings().max_model_len == 2048
    assert resource.settings().served_model_name == "from-env"


def test_served_name_defaults_to_the_model_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SERVED_MODEL_NAME", raising=False)
    monkeypatch.setenv("MODEL_PATH", str(tmp_path / "Llama-3.1-8B-Instruct"))
    assert LLMResource().generation_model() == (str(tmp_path / "Llama-3.1-8B-Instruct"), "Llama-3.1-8B-Instruct")
    monkeypatch.delenv("MODEL_PATH")
    assert LLMResource().generation_model()[1] == "SmolLM2-135M-Instruct"


def test_cpu_defaults_are_float32_and_eager():
    kwargs = engine_kwargs(EngineSettings(), "/m", "m", "generate")
    assert kwargs["dtype"] == "float32" and kwargs["enforce_eager"] is True
    assert kwargs["kv_cache_memory_bytes"] == 2**30


def test_storage_paths_and_validation_limits(monkeypatch):
    env = {"STORAGE_INPUT_PATH": "s3://b/in", "STORAGE_OUTPUT_PATH": "s3://b/out"}
    assert storage_settings_from_env(env).input_path == "s3://b/in"
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", "/data/out")
    assert StorageResource(input_path="/x").settings().output_path == "/data/out"
    assert validation_limits_from_env({"MAX_LINE_BYTES": "100", "MAX_CUSTOM_ID_LENGTH": "128"}) == {
        "max_line_bytes": 100, "max_custom_id_length": 128}
    with pytest.raises(ConfigError, match="MAX_LINE_BYTES"):
        validation_limits_from_env({"MAX_LINE_BYTES": "0"})


def test_presets_fill_defaults_and_explicit_variables_win():
    s = engine_settings_from_env({"ENGINE_PRESET": "h100-8b", "BATCH_SIZE": "64"})
    assert s.dtype == "bfloat16" and s.max_model_len == 8192 and s.enable_prefix_caching is True
    assert s.batch_size == 64  # the explicit variable, not the preset's 256
    assert s.extra_engine_args == {"enable_chunked_prefill": True}
    assert engine_settings_from_env({"ENGINE_PRESET": "h100x4-70b"}).tensor_parallel_size == 4
    with pytest.raises(ConfigError, match="ENGINE_PRESET='a100' is not a preset; choose one of cpu, h100-8b"):
        engine_settings_from_env({"ENGINE_PRESET": "a100"})


def test_checkpoint_settings_default_to_5_seconds_and_take_the_old_name():
    defaults = engine_settings_from_env({})
    assert (defaults.checkpoint_answers, defaults.checkpoint_seconds) == (256, 5.0)
    assert engine_settings_from_env({"CHECKPOINT_SECONDS": "2.5"}).checkpoint_seconds == 2.5
    assert engine_settings_from_env({"SHARD_SIZE": "64"}).checkpoint_answers == 64  # the name before CHECKPOINT_ANSWERS
    assert engine_settings_from_env({"SHARD_SIZE": "64", "CHECKPOINT_ANSWERS": "32"}).checkpoint_answers == 32
    assert LLMResource(checkpoint_seconds=3.0).settings().checkpoint_seconds == 3.0


def test_a_gpu_preset_is_refused_without_gpus_and_names_the_preset():
    from batch_pipeline.engine.engine_args import hardware_problem

    h100 = engine_settings_from_env({"ENGINE_PRESET": "h100-8b"})
    assert h100.preset == "h100-8b" and h100.dtype == "bfloat16"
    assert "ENGINE_PRESET=h100-8b is for 1 x H100 80 GB, but no GPU is visible" in hardware_problem(h100, gpus=0)
    assert hardware_problem(h100, gpus=1) is None
    tp4 = engine_settings_from_env({"ENGINE_PRESET": "h100x4-70b"})
    assert "only 2 GPU(s) are visible" in hardware_problem(tp4, gpus=2)
    assert hardware_problem(engine_settings_from_env({"ENGINE_PRESET": "cpu"}), gpus=0) is None
    assert hardware_problem(engine_settings_from_env({}), gpus=0) is None
    assert "TENSOR_PARALLEL_SIZE=2 but only 1 GPU(s)" in hardware_problem(engine_settings_from_env({"TENSOR_PARALLEL_SIZE": "2"}), gpus=1)


def test_cpu_kv_cache_default_is_1_gib_and_the_context_fits_it():
    from batch_pipeline.engine.engine_args import CPU_KV_CACHE_BYTES

    kwargs = engine_kwargs(EngineSettings(), "/m", "m", "generate")
    assert CPU_KV_CACHE_BYTES == 2**30 and kwargs["kv_cache_memory_bytes"] == 2**30
    assert kwargs["max_model_len"] == -1  # vLLM fits the context to the cache
    assert engine_kwargs(EngineSettings(max_model_len=4096), "/m", "m", "generate")["max_model_len"] == 4096
    assert "max_model_len" not in engine_kwargs(EngineSettings(), "/m", "m", "pooling")


@pytest.mark.slow
def test_partitions_start_from_the_environment_with_a_recent_default():
    import datetime as dt
    import os
    import subprocess
    import sys

    from batch_pipeline.defs.partitions import DEFAULT_PARTITIONS_START, partitions_start
    from batch_pipeline.config.settings import ConfigError

    assert partitions_start({}) == DEFAULT_PARTITIONS_START
    assert dt.date.today() - dt.date.fromisoformat(DEFAULT_PARTITIONS_START) < dt.timedelta(days=400)  # recent
    assert partitions_start({"PARTITIONS_START": "2025-06-01"}) == "2025-06-01"
    for raw, message in (("2025-6-1", "is not a date"), ("June", "is not a date"), ("2999-01-01", "is after today")):
        with pytest.raises(ConfigError, match=f"PARTITIONS_START='{raw}' {message}"):
            partitions_start({"PARTITIONS_START": raw})
    # What the definitions load with, in a fresh process (the partitions are fixed at load).
    code = ("from batch_pipeline.defs.sensors import partition_range; r = partition_range(); print(r.first, r.last)")
    env = {k: v for k, v in os.environ.items() if k != "PARTITIONS_START"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [DEFAULT_PARTITIONS_START, dt.datetime.now(dt.timezone.utc).date().isoformat()]
    env["PARTITIONS_START"] = "yesterday"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "PARTITIONS_START='yesterday' is not a date (YYYY-MM-DD)" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("variable, read, sensor", [
    ("SENSOR_INTERVAL_SECONDS", "sensor_interval_from_env", "batch_pipeline.defs.sensors import batch_upload_sensor"),
    ("ALERT_INTERVAL_SECONDS", "alert_interval_from_env", "batch_pipeline.defs.alerts import run_failure_alert_sensor"),
])
def test_a_sensors_interval_is_a_setting_read_when_the_definitions_load(variable, read, sensor):
    import os
    import subprocess
    import sys

    from batch_pipeline.config import settings
    from batch_pipeline.config.settings import ConfigError

    interval_from_env = getattr(settings, read)
    assert interval_from_env({}) == 30 and interval_from_env({variable: "300"}) == 300
    for raw in ("4", "3601", "soon"):
        with pytest.raises(ConfigError, match=f"{variable}='{raw}'"):
            interval_from_env({variable: raw})
    code = f"from {sensor} as s; print(s.minimum_interval_seconds, 'every 7 s ({variable})' in s.description)"
    env = {**os.environ, variable: "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["7", "True"]


def test_every_engine_setting_is_a_launchpad_field_naming_its_variable():
    from batch_pipeline.config.settings import ENGINE_ENV, SECRET_ENGINE_ENV

    described = {f.description.split(":")[0] for f in LLMResource.model_fields.values()}
    assert (set(ENGINE_ENV) - SECRET_ENGINE_ENV) | {"ENGINE_PRESET"} <= described, set(ENGINE_ENV) - described
    assert not SECRET_ENGINE_ENV & described  # a key in the launchpad would be kept in every run's config
    # the fields are made from EngineSettings: each says what its setting's doc says
    for f in dataclasses.fields(EngineSettings):
        if f.metadata.get("env") and not f.metadata["secret"]:
            assert f.metadata["doc"], f"{f.metadata['env']} has no doc for the launchpad"
            name = "engine_args" if f.name == "extra_engine_args" else f.name
            assert LLMResource.model_fields[name].description == f"{f.metadata['env']}: {f.metadata['doc']}"
    assert {f.description.split(":")[0] for f in StorageResource.model_fields.values()} == {"STORAGE_INPUT_PATH", "STORAGE_OUTPUT_PATH"}


def test_a_preset_and_engine_args_picked_in_the_launchpad(monkeypatch):
    from batch_pipeline.config.presets import preset
    from batch_pipeline.config.settings import ConfigError

    monkeypatch.delenv("ENGINE_PRESET", raising=False)
    monkeypatch.delenv("ENGINE_ARGS", raising=False)
    settings = LLMResource(engine_preset="h100-8b", max_model_len=4096, engine_args='{"swap_space": 2}').settings()
    assert settings.preset == "h100-8b"
    assert settings.max_model_len == 4096  # a field set here wins over the preset
    assert settings.gpu_memory_utilization == preset("h100-8b").get("gpu_memory_utilization", settings.gpu_memory_utilization)
    assert settings.extra_engine_args["swap_space"] == 2
    with pytest.raises(ConfigError, match="llm.engine_args='nope' is not a JSON object"):
        LLMResource(engine_args="nope").settings()
    with pytest.raises(ConfigError, match="ENGINE_PRESET='h300' is not a preset"):
        LLMResource(engine_preset="h300").settings()


@pytest.mark.parametrize("raw,expected", [("", 0.10), ("0.25", 0.25), (" 0 ", 0.0), ("1", 1.0)])
def test_max_failed_line_rate_is_a_share(raw, expected):
    from batch_pipeline.config.settings import max_failed_line_rate_from_env

    assert max_failed_line_rate_from_env({"MAX_FAILED_LINE_RATE": raw}) == expected


@pytest.mark.parametrize("raw,message", [("ten", "MAX_FAILED_LINE_RATE='ten' is not a valid number"),
                                         ("10", "MAX_FAILED_LINE_RATE='10' is out of range (0 to 1")])
def test_a_bad_max_failed_line_rate_names_the_variable(raw, message):
    from batch_pipeline.config.settings import ConfigError, max_failed_line_rate_from_env

    with pytest.raises(ConfigError) as refused:
        max_failed_line_rate_from_env({"MAX_FAILED_LINE_RATE": raw})
    assert message in str(refused.value)


# ------------------------------------------------------------------ base/env.py, the one parser


@pytest.mark.parametrize("reader,env,expected", [
    (lambda e: env_parse.int_in_range(e, "N", 1, 10), {}, None),
    (lambda e: env_parse.int_in_range(e, "N", 1, 10), {"N": " 7 "}, 7),
    (lambda e: env_parse.int_in_range(e, "N", 1, 10), {"N": "10"}, 10),
    (lambda e: env_parse.number_in_range(e, "T", 0, 5, above_low=True), {"T": "0.5"}, 0.5),
    (lambda e: env_parse.number_in_range(e, "T", 0, 5), {"T": "0"}, 0.0),
    (lambda e: env_parse.coerce("B", "off", bool), {}, False),
    (lambda e: env_parse.coerce("J", '{"a": 1}', "dict[str, Any]"), {}, {"a": 1}),
])
def test_env_parser_reads_each_kind(reader, env, expected):
    assert reader(env) == expected


@pytest.mark.parametrize("reader,env,message", [
    (lambda e: env_parse.int_in_range(e, "N", 1, 10, " files"), {"N": "11"}, r"N='11' is out of range \(1 to 10 files\)"),
    (lambda e: env_parse.int_in_range(e, "N", 1, 10), {"N": "1.5"}, "N='1.5' is not a valid integer"),
    (lambda e: env_parse.number_in_range(e, "T", 0, 5, " seconds", above_low=True), {"T": "0"},
     r"T='0' is out of range \(above 0 to 5 seconds\)"),
    (lambda e: env_parse.number_in_range(e, "T", 0, 5), {"T": "nan"}, "T='nan' is out of range"),
    (lambda e: env_parse.number_in_range(e, "T", 0, 5), {"T": "soon"}, "T='soon' is not a valid number"),
    (lambda e: env_parse.coerce("B", "maybe", bool), {}, "B='maybe' is not a valid boolean"),
    (lambda e: env_parse.coerce("J", "[1]", "dict[str, Any]"), {}, "J='\\[1\\]' is not a valid JSON object"),
])
def test_env_parser_errors_name_the_variable_and_value(reader, env, message):
    with pytest.raises(ConfigError, match=message):
        reader(env)


def test_every_reader_fails_the_same_way():
    # Settings, images and storage all read through base/env.py: the same wording for the same mistake.
    from batch_pipeline.config.settings import max_failed_line_rate_from_env
    from batch_pipeline.io.images import image_settings_from_env

    with pytest.raises(ConfigError, match="MAX_FAILED_LINE_RATE='2' is out of range"):
        max_failed_line_rate_from_env({"MAX_FAILED_LINE_RATE": "2"})
    with pytest.raises(ConfigError, match="IMAGE_FETCH_TIMEOUT='0' is out of range"):
        image_settings_from_env({"IMAGE_FETCH_TIMEOUT": "0"})
    with pytest.raises(ConfigError, match="MAX_IMAGE_BYTES='many' is not a valid integer"):
        image_settings_from_env({"MAX_IMAGE_BYTES": "many"})


# ------------------------------------------------------------------ one way in, one wording


@pytest.mark.parametrize("read,env,message", [
    (nightly_cron_from_env, {"NIGHTLY_CRON": "every night"}, "NIGHTLY_CRON='every night' is not a valid cron expression (five fields"),
    (nightly_cron_from_env, {"NIGHTLY_CRON": "0 2 * * * *"}, "NIGHTLY_CRON='0 2 * * * *' is not a valid cron expression"),  # seconds: not Dagster's
    (nightly_cron_from_env, {"NIGHTLY_CRON": "0 0 30 2 *"}, "NIGHTLY_CRON='0 0 30 2 *' is not a valid cron expression"),  # no 30 February
    (s3_settings_from_env, {"AWS_RETRY_MODE": "fast"}, "AWS_RETRY_MODE='fast' is not one of standard, adaptive, legacy"),
    (s3_settings_from_env, {"AWS_MAX_ATTEMPTS": "0"}, "AWS_MAX_ATTEMPTS='0' is out of range (1 to 100)"),
    (s3_settings_from_env, {"AWS_READ_TIMEOUT": "0"}, "AWS_READ_TIMEOUT='0' is out of range (above 0 to 86400 seconds)"),
    (s3_settings_from_env, {"S3_SSE": "aes256"}, "S3_SSE='aes256' is not one of AES256, aws:kms, aws:kms:dsse"),
    (validation_limits_from_env, {"MAX_LINE_BYTES": "0"}, "MAX_LINE_BYTES='0' is out of range (at least 1)"),
    (shards_from_env, {"SHARDS": "2000"}, "SHARDS='2000' is out of range (1 to 1024)"),
    (file_limits, {"BATCH_API_MAX_FILE_BYTES": "big"}, "BATCH_API_MAX_FILE_BYTES='big' is not a valid integer"),
    (min_expiry_seconds, {"BATCH_API_MIN_EXPIRY_SECONDS": "99999999"}, "BATCH_API_MIN_EXPIRY_SECONDS='99999999' is out of range (1 to 2592000"),
])
def test_each_setting_fails_in_the_one_wording_naming_variable_and_value(read, env, message):
    with pytest.raises(ConfigError) as err:
        read(env)
    assert str(err.value).startswith(message)


def test_settings_read_well_formed_values_and_keep_their_defaults():
    assert nightly_cron_from_env({}) == NIGHTLY_CRON == "0 2 * * *"
    assert nightly_cron_from_env({"NIGHTLY_CRON": " 30 4 * * 1-5 "}) == "30 4 * * 1-5"
    assert s3_settings_from_env({}) == S3Settings(8, "standard", 10.0, 60.0, "", "")
    s3 = s3_settings_from_env({"AWS_RETRY_MODE": "Legacy", "S3_SSE": "aws:kms", "S3_SSE_KMS_KEY_ID": "alias/b"})
    assert (s3.retry_mode, s3.sse_args()) == ("legacy", {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/b"})


def test_a_bad_nightly_cron_fails_the_definitions_naming_it(monkeypatch):
    from batch_pipeline.defs.schedules import schedules

    monkeypatch.setenv("NIGHTLY_CRON", "at two")
    with pytest.raises(ConfigError, match="NIGHTLY_CRON='at two' is not a valid cron"):
        schedules()


def test_a_webhook_url_is_refused_without_repeating_it():
    from batch_pipeline.defs.alerts import webhook_url_from_env

    assert webhook_url_from_env({}) is None
    assert webhook_url_from_env({"ALERT_WEBHOOK_URL": "https://hooks.example/x"}) == "https://hooks.example/x"
    with pytest.raises(ConfigError) as err:
        webhook_url_from_env({"ALERT_WEBHOOK_URL": "hooks.example/token-123"})
    assert str(err.value) == "ALERT_WEBHOOK_URL is not an http:// or https:// URL with a host"  # no token in logs


@pytest.mark.parametrize("variable,field,bad", [("BATCH_SIZE", "batch_size", 0),
                                                ("GPU_MEMORY_UTILIZATION", "gpu_memory_utilization", 1.5),
                                                ("ENGINE_WAIT_SECONDS", "engine_wait_seconds", -1.0)])
def test_an_engine_setting_out_of_range_reads_the_same_from_the_environment_and_the_launchpad(variable, field, bad):
    with pytest.raises(ConfigError) as from_env:
        engine_settings_from_env({variable: str(bad)})
    with pytest.raises(ConfigError) as from_launchpad:
        EngineSettings(**{field: bad})
    assert str(from_env.value) == str(from_launchpad.value)
    assert str(from_env.value).startswith(f"{variable}={bad!r} is out of range (")


def test_an_engine_setting_is_its_field():
    # Its variable, range, secrecy, old name and MODELS_FILE role are the field's (`setting`), so
    # ENGINE_ENV and the tables derived from it cannot drift from the fields.
    from dataclasses import fields

    from batch_pipeline.config import settings

    named = {f.name for f in fields(EngineSettings) if "env" in f.metadata}
    assert named == {f.name for f in fields(EngineSettings)} - {"preset"}  # ENGINE_PRESET is read apart
    assert settings.ENGINE_ENV["BATCH_SIZE"] == "batch_size" and settings.ENGINE_ENV_ALIASES == {"SHARD_SIZE": "CHECKPOINT_ANSWERS"}
    assert settings.SECRET_ENGINE_ENV == {"ENGINE_API_KEY"}
    assert "secret-key" not in repr(EngineSettings(engine_api_key="secret-key"))


def test_the_doctor_parses_the_s3_settings_before_any_run(monkeypatch):
    from batch_pipeline.cli import doctor

    monkeypatch.setenv("AWS_RETRY_MODE", "fast")
    result = doctor.check_settings()
    assert result.status == "FAIL" and "AWS_RETRY_MODE='fast'" in result.detail

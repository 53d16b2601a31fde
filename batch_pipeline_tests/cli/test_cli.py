"""The `batch-pipeline` command line: validate, run and model prepare.

`validate`, `model prepare` and failing runs are exercised in-process through `main()`; one test
runs the real console script in a subprocess on the tiny model (a fresh process: its own vLLM import
and engine), with DAGSTER_HOME set so the run must land in that instance, and another runs it on a
chat, an embeddings, a score and a mixed file (two at a time), each of which must exit soon after
its results line (an embeddings or score run used to hang there for ever: issue #25).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg

from batch_pipeline.cli.main import EXIT_FAILED, EXIT_INVALID_LINES, EXIT_OK, main
from batch_pipeline import contract
from batch_pipeline_tests.support.cli_runs import EXIT_AFTER_RESULTS, jsonl_records, read_results
from batch_pipeline_tests.support import EMBED_NAME, REPO, TINY_NAME, tiny_env

SAMPLE = REPO / "batch_pipeline" / "samples" / "sample_batch.jsonl"


def chat_line(custom_id: str, **body) -> str:
    payload = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": payload})


def test_validate_reports_each_bad_line_and_exits_1(capsys):
    code = main(["validate", str(SAMPLE)])
    out = capsys.readouterr().out
    assert code == EXIT_INVALID_LINES
    assert "line 6 [invalid_json] custom_id='broken-001'" in out
    assert "line 21 [invalid_request] custom_id='too-hot': body.temperature" in out
    assert "30 requests: 25 valid, 5 invalid" in out


def test_validate_clean_file_exits_0(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text(chat_line("a") + "\n" + chat_line("b") + "\n")
    assert main(["validate", str(path), "--served-model-name", TINY_NAME]) == EXIT_OK
    assert "2 requests: 2 valid, 0 invalid" in capsys.readouterr().out


def test_validate_a_csv_table_names_rows_and_columns(tmp_path, capsys):
    path = tmp_path / "rows.csv"
    path.write_text("custom_id,prompt,max_tokens,region\na,hello,3,eu\nb,,3,us\nc,hi,many,eu\n")
    assert main(["validate", str(path), "--served-model-name", TINY_NAME]) == EXIT_INVALID_LINES
    out = capsys.readouterr().out
    assert "line 2 [invalid_request] custom_id='b': column `prompt` is empty" in out
    assert "line 3 [invalid_request] custom_id='c': column `max_tokens` must be an integer, got 'many'" in out
    assert "3 requests: 1 valid, 2 invalid" in out


def test_validate_missing_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.jsonl")]) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batch-pipeline: error:") and "nope.jsonl" in err[0]


def test_run_of_a_file_with_no_valid_line_fails_with_a_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xef\xbb\xbf[1]\r\n{oops\n")
    out = tmp_path / "out"
    assert main(["run", str(path), "--output-dir", str(out)]) == EXIT_FAILED
    captured = capsys.readouterr()
    assert "every one of the 2 lines is invalid" in captured.err
    assert json.loads((out / "batch.json").read_text())["status"] == "failed"


def test_run_of_a_missing_input_fails_fast(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.jsonl"), "--output-dir", str(tmp_path / "o")]) == EXIT_FAILED
    assert "input not found" in capsys.readouterr().err


def test_model_prepare_prints_the_folder_last(bundled_model_dir, capsys):
    assert main(["model", "prepare"]) == EXIT_OK
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(last) == bundled_model_dir and (Path(last) / "config.json").is_file()


def test_console_script_runs_a_batch_and_records_it_in_dagster_home(tiny_model_dir, tmp_path):
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join([chat_line("c-1"), chat_line("c-2", n=2), '{"custom_id": "c-3", "method": "GET"}']))
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    out = tmp_path / "results"
    env = tiny_env(tiny_model_dir, DAGSTER_HOME=str(home))
    script = Path(sys.executable).parent / "batch-pipeline"
    proc = subprocess.run(
        [str(script), "run", str(batch), "--output-dir", str(out), "--date", "2026-11-02"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "requests (100%)" in proc.stderr  # progress with a rate and an ETA
    assert f"results in {out}" in proc.stdout
    assert "3 requests, 2 completed, 1 failed" in proc.stdout
    assert sorted(r["custom_id"] for r in jsonl_records((out / "output.jsonl").read_text())) == ["c-1", "c-2"]

    with dg.DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
        assert run.is_success and run.tags.get("dagster/partition") == "2026-11-02"
        assert run.job_name == "batch_job"  # listed under the job's name in Runs, not __ephemeral_asset_job__
        assert run.tags["batch_pipeline/source"] == "cli" and run.tags["batch_pipeline/batch_name"] == "in"
        assert run.tags["batch_pipeline/input_uri"] == str(batch) and run.tags["batch_pipeline/output_uri"] == str(out)
        event = instance.get_latest_materialization_event(dg.AssetKey("batch_outputs"))
        assert event is not None and event.run_id == run.run_id
        # vLLM is imported in the validation step, not while the GPU step holds its pool slot.
        said = [(e.step_key, e.message or "") for e in instance.all_logs(run.run_id)]
        assert [step for step, message in said if "vLLM imported ahead of the GPU step" in message] == ["validated_requests"]
        assert not [m for step, m in said if step == "inference_results" and "importing vLLM and torch" in m]


def pooling_line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": EMBED_NAME, **body}})


EMBEDDINGS = [pooling_line("e-1", contract.EMBEDDINGS_URL, input="The food was delicious."),
              pooling_line("e-2", contract.EMBEDDINGS_URL, input=["hello", "world"])]
SCORES = [pooling_line("s-1", contract.SCORE_URL, queries="capital of France?", documents=["Paris", "Bananas"]),
          pooling_line("s-2", contract.SCORE_URL, text_1="a cat", text_2="a kitten")]
# Chat, embeddings and score lines: the run builds a generation engine and a pooling one.
MIXED = [chat_line("c-1"), *EMBEDDINGS, *SCORES]


def test_the_command_exits_soon_after_its_results(cli_runs, tiny_model_dir, tmp_path):
    """The real `batch-pipeline run`, as a script or cron job calls it: it must end, with its exit
    code, within seconds of printing where its results are. (A pooling model's idle thread-pool
    worker held the exit of embeddings and score runs for ever.) One file needing every kind of
    engine: whichever of them left something behind would hold this exit too. Runs of one kind each
    were four vLLM imports for what this one covers (about 40 CPU-s of the suite); how the process
    ends is tested case by case, without an engine, in test_runtime.py."""
    batch = tmp_path / "mixed.jsonl"
    batch.write_text("\n".join(MIXED) + "\n")
    run = cli_runs(batch, tmp_path / "out", tiny_env(tiny_model_dir))
    assert run.wait(timeout=600) == 0, run.tail()
    took = run.seconds_from_results_to_exit()
    assert took < EXIT_AFTER_RESULTS, f"exited {took:.1f}s after printing its results"
    assert "still running" not in run.text("err"), run.tail()  # no thread was left behind either
    outputs, errors, _ = read_results(tmp_path / "out")
    assert not errors, errors
    assert sorted(r["custom_id"] for r in outputs) == sorted(json.loads(x)["custom_id"] for x in MIXED)
    kinds = {r["custom_id"]: r["response"]["body"].get("object") for r in outputs}
    assert kinds["c-1"] == "chat.completion" and kinds["e-1"] == "list", kinds


def test_run_creates_a_missing_dagster_home(tmp_path, monkeypatch, capsys):
    home = tmp_path / "new_home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    path = tmp_path / "bad.jsonl"
    path.write_text("[1]\n")
    assert main(["run", str(path), "--output-dir", str(tmp_path / "out")]) == EXIT_FAILED  # batch failed...
    assert home.is_dir()  # ...but the run was recorded, not refused for a missing folder
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert len(instance.get_runs()) == 1


def test_run_refuses_a_gpu_preset_on_a_machine_without_gpus(tmp_path, monkeypatch, capsys):
    """Defect: ENGINE_PRESET=h100-8b on a CPU machine went on to load the model with bf16 and 8k context."""
    monkeypatch.setenv("ENGINE_PRESET", "h100-8b")
    path = tmp_path / "in.jsonl"
    path.write_text(chat_line("a") + "\n")
    assert main(["run", str(path), "--output-dir", str(tmp_path / "out")]) == EXIT_FAILED
    assert "ENGINE_PRESET=h100-8b is for 1 x H100 80 GB, but no GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any step ran

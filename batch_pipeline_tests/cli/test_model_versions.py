"""Model versions (MODELS_FILE `versions`), checksums and the alias an operator switches and rolls back.

`summ` has two versions: v1 is the bundled SmolLM2 (it knows Paris), v2 the tiny random Llama (it
does not), each with the checksums of its weight files. Runs are in-process on the session's shared
engines; the alias is switched with the real `batch-pipeline model` commands.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.cli import main as cli
from batch_pipeline.config.model_versions import (
    checksums_of,
    parse_pins,
    resolve,
    verify_checksums,
)
from batch_pipeline.config.settings import ConfigError, EngineSettings
from batch_pipeline import contract
from batch_pipeline.io import model_aliases
from batch_pipeline.cli.model_commands import compare
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch

FRANCE = "What is the capital of France?"


def line(custom_id: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": FRANCE}], "max_tokens": 8, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": contract.CHAT_URL, "body": body})


@pytest.fixture
def versioned(tmp_path, bundled_model_dir, tiny_model_dir, monkeypatch):
    """MODELS_FILE with summ@v1 (SmolLM2) and summ@v2 (tiny), v1 current; STORAGE_OUTPUT_PATH for the alias."""
    path = tmp_path / "models.yaml"
    path.write_text(
        "summ:\n"
        "  seed: 3\n"
        "  versions:\n"
        f"    v1: {{path: {bundled_model_dir}, max_model_len: 2048, sha256: {json.dumps(checksums_of(bundled_model_dir))}}}\n"
        f"    v2: {{path: {tiny_model_dir}, max_model_len: 512, sha256: {json.dumps(checksums_of(tiny_model_dir))}}}\n"
        "  current: v1\n")
    out = tmp_path / "out"
    monkeypatch.setenv("MODELS_FILE", str(path))
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(out))
    return path, out


def run_date(llm, tmp_path, name: str, lines: list[str], **fields) -> dict[str, dict]:
    """One run of a date holding one file; {custom_id: output or error record}."""
    inbox, out = tmp_path / f"in-{name}", tmp_path / "out"
    write_batch(inbox / DATE, f"{name}.jsonl", lines)
    result = materialize(llm.rebuilt(**fields), str(inbox), str(out), instance=dg.DagsterInstance.ephemeral())
    assert result.success
    folder = out / DATE / name
    records = {r["custom_id"]: r for r in read_jsonl(str(folder / "output.jsonl"))}
    records.update({r["custom_id"]: r for r in read_jsonl(str(folder / "errors.jsonl"))})
    records["_inference"] = json.loads((folder / "_work" / "inference.json").read_text())
    return records


def answer(record: dict) -> tuple[str, str]:
    body = record["response"]["body"]
    return body["model"], body["choices"][0]["message"]["content"]


def test_new_runs_follow_the_alias_and_a_rollback_and_explicit_versions_and_pins_win(tiny_llm, versioned, tmp_path,
                                                                                       capsys):
    models_file, out = versioned
    llm = tiny_llm.rebuilt(models_file=str(models_file))

    first = run_date(llm, tmp_path, "a", [line("plain", "summ"), line("pinned", "summ@v2")])
    assert answer(first["plain"])[0] == "summ@v1" and "Paris" in answer(first["plain"])[1]  # MODELS_FILE's current
    assert answer(first["pinned"])[0] == "summ@v2" and "Paris" not in answer(first["pinned"])[1]
    assert first["_inference"]["engine"]["model_versions"] == "summ=v1"

    assert cli.main(["model", "use", "summ@v2", "--by", "test"]) == 0
    said = capsys.readouterr().out
    assert "summ@v2: 1 weight file(s) match their checksums" in said and "new batches use v2 (was v1)" in said
    second = run_date(llm, tmp_path, "b", [line("plain", "summ"), line("pinned", "summ@v1")])
    assert answer(second["plain"])[0] == "summ@v2" and "Paris" not in answer(second["plain"])[1]
    assert answer(second["pinned"])[0] == "summ@v1" and "Paris" in answer(second["pinned"])[1]
    assert second["_inference"]["engine"]["model_versions"] == "summ=v2"

    # MODEL_VERSIONS (the Batch API's pin at create) wins over the alias.
    pinned = run_date(llm, tmp_path, "c", [line("plain", "summ")], model_versions="summ=v1")
    assert answer(pinned["plain"])[0] == "summ@v1"

    assert cli.main(["model", "rollback", "summ", "--by", "test"]) == 0
    assert "rolled back from v2 to v1" in capsys.readouterr().out
    third = run_date(llm, tmp_path, "d", [line("plain", "summ"), line("nope", "summ@v3")])
    assert answer(third["plain"])[0] == "summ@v1"
    assert third["nope"]["error"]["code"] == contract.MODEL_NOT_FOUND  # an unknown version is a line error
    history = model_aliases.read_document(str(out))["summ"]["history"]
    assert [(h["version"], h["action"], h["by"]) for h in history] == [("v2", "use", "test"), ("v1", "rollback", "test")]

    assert cli.main(["model", "list", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["summ@v1"]["use"] == "new batches, MODELS_FILE current, alias" and rows["summ@v2"]["checksums"] == "yes"


def test_a_changed_or_truncated_weight_file_is_refused_before_the_model_loads(tiny_llm, tiny_model_dir, tmp_path,
                                                                              monkeypatch, capsys):
    copy = tmp_path / "tiny-copy"
    shutil.copytree(tiny_model_dir, copy)
    sums = checksums_of(copy)
    [weights] = list(sums)
    models_file = tmp_path / "models.yaml"
    models_file.write_text(f"summ:\n  versions:\n    v1: {{path: {copy}, max_model_len: 512, sha256: {json.dumps(sums)}}}\n")
    monkeypatch.setenv("MODELS_FILE", str(models_file))
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(tmp_path / "out"))
    assert verify_checksums("summ@v1", copy, sums) == 1 and verify_checksums("summ@v1", copy, sums) == 0  # remembered

    with (copy / weights).open("r+b") as f:  # truncated: half the file gone
        f.truncate((copy / weights).stat().st_size // 2)
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "a.jsonl", [line("x", "summ")])
    instance = dg.DagsterInstance.ephemeral()
    result = materialize(tiny_llm.rebuilt(models_file=str(models_file)), str(inbox), str(out), instance=instance)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    message = str(failure.step_failure_data.error.to_string())
    assert f"summ@v1: weight file {copy / weights} does not match its checksum" in message
    assert "refusing to load this version" in message
    logs = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert not [m for m in logs if m.startswith("loading generate model summ@v1")], logs  # refused before the load

    # `model verify` and `model use` refuse it too, naming the file; the alias stays where it was.
    assert cli.main(["model", "verify", "summ@v1"]) == 2
    assert f"{copy / weights} does not match its checksum" in capsys.readouterr().err
    (copy / weights).unlink()
    assert cli.main(["model", "use", "summ@v1"]) == 2
    assert f"weight file {copy / weights} is missing" in capsys.readouterr().err
    assert model_aliases.read_aliases(str(tmp_path / "out")) == {}


def test_a_changed_file_of_the_same_size_is_read_again(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"a" * 1000)
    sums = checksums_of(folder)
    assert verify_checksums("m@1", folder, sums) == 1 and verify_checksums("m@1", folder, sums) == 0
    (folder / "model.safetensors").write_bytes(b"b" * 1000)  # same size, new content (a new mtime)
    with pytest.raises(ConfigError, match=r"m@1: weight file .*model.safetensors does not match its checksum"):
        verify_checksums("m@1", folder, sums)


def test_models_file_versions_are_checked_naming_the_entry(tmp_path):
    def registry(text: str):
        path = tmp_path / "m.yaml"
        path.write_text(text)
        s = EngineSettings(models_file=str(path))
        return s.model_registry(), s.versioned_models()

    entries, versioned = registry("s:\n  batch_size: 4\n  versions:\n    a: /x\n    b: {path: /y, batch_size: 8}\n")
    assert {k: (v.model_path, v.batch_size) for k, v in entries.items()} == {"s@a": ("/x", 4), "s@b": ("/y", 8)}
    assert versioned["s"].current == "b"  # no `current`: the last listed
    for text, error in [
        ("s:\n  path: /x\n  versions: {a: /y}\n", r"model 's' has versions: its path and sha256 go under each version"),
        ("s:\n  versions: {a: /y}\n  current: z\n", r"model 's': current 'z' is not one of its versions \(a\)"),
        ("s:\n  versions: {'a b': /y}\n", r"model 's' has a version 'a b'"),
        ("s@1: /y\n", r"model name 's@1' may not contain '@'"),
        ("s:\n  versions: {a: {path: /y, sha256: {w.bin: abc}}}\n", r"model 's@a': sha256 must map each weight file"),
        ("s:\n  versions: []\n", r"model 's': versions must map a version"),
    ]:
        with pytest.raises(ConfigError, match=r"MODELS_FILE=.*m.yaml: " + error):
            registry(text)
    with pytest.raises(ConfigError, match=r"MODEL_VERSIONS='s' : 's' is not name=version|is not name=version"):
        parse_pins("s")
    with pytest.raises(ConfigError, match=r"MODEL_VERSIONS: 's' has no version 'c' \(versions: a, b\)"):
        resolve(versioned, {}, {"s": "c"})
    assert resolve(versioned, {"s": "gone"}, {}) == {"s": "b"}  # an alias whose version left the file: current


def test_rollback_walks_back_through_the_switches(tmp_path):
    from batch_pipeline.config.model_versions import ModelVersions

    model = ModelVersions("s", ("v1", "v2", "v3"), "v1")
    root = str(tmp_path)
    with pytest.raises(ConfigError, match="'s' has no earlier version to roll back to"):
        model_aliases.rollback(root, model)
    model_aliases.switch(root, model, "v2")
    model_aliases.switch(root, model, "v3")
    assert model_aliases.rollback(root, model) == ("v3", "v2")
    assert model_aliases.rollback(root, model) == ("v2", "v1")
    with pytest.raises(ConfigError, match="no earlier version"):
        model_aliases.rollback(root, model)
    with pytest.raises(ConfigError, match="'s' has no version 'v9'"):
        model_aliases.switch(root, model, "v9")


def test_the_golden_comparison_counts_greedy_exact_matches_and_candidate_failures():
    def out(cid: str, text: str | None) -> dict:
        if text is None:
            return {"custom_id": cid, "response": None, "error": {"code": "context_length_exceeded"}}
        return {"custom_id": cid, "response": {"status_code": 200, "body": {"choices": [{"message": {"content": text}}]}}}

    lines = [{"custom_id": c, "body": {"temperature": t}} for c, t in (("a", 0), ("b", 0), ("c", 0), ("d", 1.0))]
    answers = {r["custom_id"]: r for r in [out("candidate:a", "x"), out("current:a", "x"), out("candidate:b", "y"),
                                            out("current:b", "z"), out("candidate:c", None), out("current:c", "w"),
                                            out("candidate:d", "p"), out("current:d", "q")]}
    report = compare(lines, answers, "s@2", "s@1", "/r")
    assert report["greedy"] == {"lines": 3, "exact_matches": 1, "exact_match_rate": 1 / 3}
    assert report["candidate_failed_lines"] == 1
    assert [r["custom_id"] for r in report["differences"]] == ["b", "c", "d"]
    assert report["differences"][1]["candidate"] == "<no answer: context_length_exceeded>"


def test_model_verify_compares_a_golden_batch_with_the_current_version(tiny_model_dir, tmp_path):
    """`batch-pipeline model verify --golden` as an operator runs it (a subprocess): a copy of the
    current weights matches on every greedy line; weights with noise added do not, and it exits 1."""
    import subprocess
    import sys
    import time

    import torch
    from safetensors.torch import load_file, save_file

    same, noisy = tmp_path / "same", tmp_path / "noisy"
    shutil.copytree(tiny_model_dir, same)
    shutil.copytree(tiny_model_dir, noisy)
    [weights] = checksums_of(noisy)
    tensors = load_file(noisy / weights)
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + torch.randn(v.shape, generator=generator, dtype=v.dtype) * v.float().std().to(v.dtype)
               for k, v in tensors.items()}, noisy / weights, metadata={"format": "pt"})
    models_file = tmp_path / "models.yaml"
    models_file.write_text("summ:\n  max_model_len: 512\n  versions:\n"
                           f"    v1: {tiny_model_dir}\n    v2: {{path: {same}, sha256: {json.dumps(checksums_of(same))}}}\n"
                           f"    v3: {{path: {noisy}, sha256: {json.dumps(checksums_of(noisy))}}}\n  current: v1\n")
    golden = tmp_path / "golden.jsonl"
    lines = [json.loads(line(f"g{i}", "summ")) for i in range(6)]
    for i, item in enumerate(lines):
        item["body"]["messages"][0]["content"] = f"question number {i}: {'why ' * i}"
    lines.append({**lines[0], "custom_id": "sampled", "body": {**lines[0]["body"], "temperature": 1.0}})
    golden.write_text("".join(json.dumps(item) + "\n" for item in lines))
    from batch_pipeline_tests.support import tiny_env

    env = tiny_env(tiny_model_dir, MODELS_FILE=str(models_file), STORAGE_OUTPUT_PATH=str(tmp_path / "out"))
    command = [str(Path(sys.executable).with_name("batch-pipeline")), "model", "verify"]

    # Both at once (their vLLM imports and model loads overlap), each in its own work folder and
    # output files (files, not pipes: neither waits on the other's being read).
    def verify(name: str, *args: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            return subprocess.Popen([*command, *args], stdout=out, stderr=err, text=True, env=env)

    runs: dict[str, subprocess.Popen] = {}
    try:
        runs["v2"] = verify("v2", "summ@v2", "--golden", str(golden), "--min-match", "1", "--report",
                            str(tmp_path / "v2.json"), "--work-dir", str(tmp_path / "w2"))
        runs["v3"] = verify("v3", "summ@v3", "--golden", str(golden), "--min-match", "0.99", "--report",
                            str(tmp_path / "v3.json"), "--work-dir", str(tmp_path / "w3"))
        deadline = time.monotonic() + 600
        for run in runs.values():
            run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    ok, bad = (subprocess.CompletedProcess(runs[n].args, runs[n].returncode, (tmp_path / f"{n}.out").read_text(),
                                           (tmp_path / f"{n}.err").read_text()) for n in ("v2", "v3"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "summ@v2: 1 weight file(s) match their checksums" in ok.stdout
    assert "greedy lines (temperature 0): 6, the same answer on both: 6 (100.0%)" in ok.stdout
    report = json.loads((tmp_path / "v2.json").read_text())
    assert (report["candidate"], report["current"], report["lines"]) == ("summ@v2", "summ@v1", 7)

    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads((tmp_path / "v3.json").read_text())
    assert report["greedy"]["exact_match_rate"] < 0.99 and "FAIL: exact-match rate of greedy lines" in bad.stdout
    assert {row["custom_id"] for row in report["differences"]} - {"sampled"}  # greedy lines differ, named


def test_schedule_and_sensor_runs_are_pinned_to_the_versions_of_their_tick(tmp_path, monkeypatch):
    """A run the schedule or the sensor requests carries the versions the aliases named at its tick, so
    it keeps them if it starts after a switch (the Batch API pins at create the same way)."""
    from batch_pipeline.config.model_versions import ModelVersions
    from batch_pipeline.defs.jobs import batch_run_config
    from batch_pipeline.defs.resources import StorageResource
    from batch_pipeline.defs.schedules import nightly_requests

    models_file = tmp_path / "models.yaml"
    models_file.write_text("s:\n  versions: {a: /models/a, b: /models/b}\n  current: a\nplain: /models/p\n")
    monkeypatch.setenv("MODELS_FILE", str(models_file))
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(tmp_path / "out"))
    monkeypatch.delenv("MODEL_VERSIONS", raising=False)

    def pins(config: dict | None) -> str | None:
        return ((config or {}).get("resources", {}).get("llm") or {}).get("config", {}).get("model_versions")

    day = tmp_path / "in" / "2026-11-29"
    day.mkdir(parents=True)
    (day / "x.jsonl").write_text("{}\n")
    storage = StorageResource(input_path=str(tmp_path / "in"), output_path=str(tmp_path / "out"))
    [tick] = nightly_requests("2026-11-29", storage)  # the schedule's tick at 02:00 on the 30th
    assert pins(tick.run_config) == "s=a"
    model_aliases.switch(str(tmp_path / "out"), ModelVersions("s", ("a", "b"), "a"), "b")
    assert pins(batch_run_config(input_uri="s3://in/x.jsonl")) == "s=b"  # the sensor's run requests
    assert pins(batch_run_config(input_uri="x", model_versions="")) is None  # "": resolved when the run starts
    models_file.write_text("s:\n  versions: {a: /models/a}\n  current: zz\n")  # broken: the run will say why
    assert pins(batch_run_config(input_uri="x")) is None
    monkeypatch.delenv("MODELS_FILE")
    assert pins(batch_run_config(input_uri="x")) is None
    [tick] = nightly_requests("2026-11-29", storage)
    assert not tick.run_config  # without versioned models the nightly run's config stays blank


def test_an_unversioned_entry_with_checksums_is_verified_too(tmp_path):
    """sha256 on a plain MODELS_FILE entry is checked before its load like a version's (no builder is reached)."""
    from batch_pipeline.engine.local import Engines

    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    models_file = tmp_path / "models.yaml"
    models_file.write_text(f"plain: {{path: {folder}, sha256: {json.dumps({'model.safetensors': '0' * 64})}}}\n")

    def builder(_kwargs):
        raise AssertionError("the model was loaded before its checksum was checked")

    engines = Engines(EngineSettings(models_file=str(models_file)), "/default", "default", None, None, builder=builder)
    with pytest.raises(ConfigError, match=r"plain: weight file .*model.safetensors does not match its checksum"):
        engines._model("plain")

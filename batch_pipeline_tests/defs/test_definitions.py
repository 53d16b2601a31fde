"""The entry point (batch_pipeline/definitions.py): a run worker builds the defs folder without the
plugin descriptions `load_from_defs_folder` adds for the UI, and gets the same definitions."""

import warnings

import dagster as dg

from batch_pipeline import definitions


def test_a_run_worker_is_known_by_dagsters_command_or_as_a_code_servers_child():
    assert definitions.in_a_run_worker(["/venv/bin/dagster", "api", "execute_run", "{...}"], spawned=False)
    assert definitions.in_a_run_worker(["/venv/lib/python3.11/site-packages/dagster/__main__.py", "api", "resume_run", "{}"],
                                       spawned=False)
    assert definitions.in_a_run_worker(["-c", "--multiprocessing-fork"], spawned=True)  # a code server's run
    assert not definitions.in_a_run_worker(["/venv/bin/dagster", "api", "grpc", "-m", "batch_pipeline.definitions"],
                                           spawned=False)
    assert not definitions.in_a_run_worker(["/venv/bin/dagster", "dev", "-w", "workspace.yaml"], spawned=False)
    assert not definitions.in_a_run_worker(["/venv/bin/batch-pipeline", "run", "execute_run.jsonl"], spawned=False)
    assert not definitions.in_a_run_worker()  # this test process


def summary(defs: dg.Definitions) -> dict[str, list[str]]:
    repo = defs.get_repository_def()
    return {"assets": sorted(k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()),
            "checks": sorted(str(k) for k in repo.asset_graph.asset_check_keys),
            "jobs": sorted(j.name for j in repo.get_all_jobs()),
            "sensors": sorted(s.name for s in repo.sensor_defs),
            "schedules": sorted(s.name for s in repo.schedule_defs),
            "resources": sorted(defs.resources or {})}


def test_a_run_worker_loads_the_same_definitions_without_the_plugin_descriptions(monkeypatch):
    ui = definitions.defs_folder()
    monkeypatch.setattr(definitions, "in_a_run_worker", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = definitions.defs_folder()
    # None of Dagster's warnings for each run's stderr (its preview loaders warned twice there before).
    assert [str(w.message)[:120] for w in caught if issubclass(w.category, (dg.PreviewWarning, dg.BetaWarning))] == []
    assert summary(worker) == summary(ui)
    assert "batch_file_job" in summary(worker)["jobs"] and summary(worker)["assets"]  # not two empty loads
    assert "plugin_component_types_json" in (ui.metadata or {})  # what the UI's component pages read
    assert "plugin_component_types_json" not in (worker.metadata or {})

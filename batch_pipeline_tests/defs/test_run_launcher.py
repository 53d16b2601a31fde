"""`ForkedRunLauncher` with real runs: each worker a fork of the warm process, afresh after an edit, a
killed worker failing its run, a terminate cancelling it, another Python getting a new process.

The runs are real Dagster runs of two small jobs (support/launched_jobs.py) on a SQLite instance whose
run launcher is the one dagster.yaml names; the workers are real processes (the fork server's children).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from batch_pipeline.defs import run_launcher, run_worker
from batch_pipeline.defs.run_launcher import PID_TAG, ForkedRunLauncher
from batch_pipeline_tests.support.launched_jobs import held_job, quick_job
from batch_pipeline_tests.support.waiting import wait_for

# Each test here starts Dagster run workers in processes of their own (3-11 s each): not in `make test-fast`.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FINISHED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


@pytest.fixture(scope="module")
def own_module(tmp_path_factory):
    """A module of the code location's own (outside the venv) that the fork server imports too: the
    launcher's `preload`. The fork server is this process's one, started by the first launch with these
    settings; it finds the module on PYTHONPATH (Python 3.11's fork server does not take its parent's
    sys.path)."""
    folder = tmp_path_factory.mktemp("own")
    name = f"own_module_{os.getpid()}"
    (folder / f"{name}.py").write_text("OWN = True\n")
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), before]))
    yield folder / f"{name}.py", name
    if before is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture
def instance(tmp_path, own_module):
    """A SQLite instance with the repo's dagster.yaml run launcher (preloading `own_module` too)."""
    launcher = yaml.safe_load((REPO / "dagster.yaml").read_text())["run_launcher"]
    launcher = {**launcher, "config": {"preload": [own_module[1]]}}
    with dg.instance_for_test(temp_dir=str(tmp_path), overrides={"run_launcher": launcher}) as inst:
        assert isinstance(inst.run_launcher, ForkedRunLauncher)
        yield inst


def _launch(instance, job, run_config=None, executable: str | None = None) -> str:
    origin = dg.reconstructable(job).get_python_origin()
    if executable:
        origin = origin._replace(repository_origin=origin.repository_origin._replace(executable_path=executable))
    run = instance.create_run_for_job(job_def=job, run_config=run_config, job_code_origin=origin)
    instance.launch_run(run.run_id, workspace=None)
    return run.run_id


def _finished(instance, run_id: str, timeout: float = 90) -> dg.DagsterRun:
    return wait_for(f"run {run_id} to finish", lambda: (r := instance.get_run_by_id(run_id)) and r.status in FINISHED and r,
                    timeout, interval=0.2, on_timeout=lambda: "\n".join(_messages(instance, run_id)[-8:]))


def _messages(instance, run_id: str) -> list[str]:
    return [e.message for e in instance.all_logs(run_id)]


def _worker_pid(instance, run_id: str) -> int:
    tag = wait_for("the worker's pid tag", lambda: instance.get_run_by_id(run_id).tags.get(PID_TAG), 30, interval=0.1)
    return int(tag.split("@")[0])


def test_each_run_is_a_fork_of_the_warm_process(instance):
    first, second = _launch(instance, quick_job), _launch(instance, quick_job)
    pids = set()
    for run_id in (first, second):
        assert _finished(instance, run_id).status == dg.DagsterRunStatus.SUCCESS, _messages(instance, run_id)
        messages = _messages(instance, run_id)
        assert any(m.startswith("Run worker forked from the warm process") for m in messages), messages
        pids.add(_worker_pid(instance, run_id))
    assert len(pids) == 2 and os.getpid() not in pids  # a process per run, never this one


def test_a_run_starts_afresh_when_the_project_changed_since_the_fork(instance, own_module):
    """An edit after the fork server imported the code: the run's worker runs the edited code, as a new
    process would (the same command, `execv`), and says why."""
    assert _finished(instance, _launch(instance, quick_job)).status == dg.DagsterRunStatus.SUCCESS
    edited = own_module[0]
    edited.write_text("OWN = 'edited'\n")
    run_id = _launch(instance, quick_job)
    assert _finished(instance, run_id).status == dg.DagsterRunStatus.SUCCESS, _messages(instance, run_id)
    assert f"Run worker started afresh: {edited} changed since the warm process imported it." in _messages(instance, run_id)


def test_a_killed_worker_fails_its_run_saying_how(instance, tmp_path):
    run_id = _launch(instance, held_job, {"ops": {"hold": {"config": {"release": str(tmp_path / "never")}}}})
    wait_for("the run to start", lambda: instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.STARTED, 60, 0.2)
    run = instance.get_run_by_id(run_id)
    assert instance.run_launcher.check_run_worker_health(run).status == dg._core.launcher.WorkerStatus.RUNNING
    os.kill(_worker_pid(instance, run_id), signal.SIGKILL)
    assert _finished(instance, run_id).status == dg.DagsterRunStatus.FAILURE
    assert f"Run execution process for {run_id} was terminated by signal 9 (SIGKILL)." in " ".join(_messages(instance, run_id))
    assert instance.run_launcher.check_run_worker_health(run).status == dg._core.launcher.WorkerStatus.FAILED


def test_terminate_interrupts_the_worker_and_the_run_ends_cancelled(instance, tmp_path):
    run_id = _launch(instance, held_job, {"ops": {"hold": {"config": {"release": str(tmp_path / "never")}}}})
    wait_for("the run to start", lambda: instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.STARTED, 60, 0.2)
    pid = _worker_pid(instance, run_id)
    # another launcher (the web server's, say) finds the worker by the run's tag
    other = ForkedRunLauncher()
    other.register_instance(instance)
    assert other.terminate(run_id)
    assert _finished(instance, run_id).status == dg.DagsterRunStatus.CANCELED
    wait_for("the worker to exit", lambda: run_launcher.process_start(pid) is None, 30, 0.2)
    assert not other.terminate(run_id)  # finished: nothing to interrupt


def test_a_run_of_another_python_gets_a_new_process(instance):
    """A code location whose Python is another executable (here another name of this venv's Python,
    which the launcher cannot tell from another environment's) is started as a new process of it."""
    other_python = next(p for p in (Path(sys.executable).with_name(n) for n in ("python3", "python3.11", "python"))
                        if p.exists() and str(p) != sys.executable)
    run_id = _launch(instance, quick_job, executable=str(other_python))
    assert _finished(instance, run_id, timeout=120).status == dg.DagsterRunStatus.SUCCESS, _messages(instance, run_id)
    assert not any(m.startswith("Run worker") for m in _messages(instance, run_id))


def test_forks_only_this_python():
    assert ForkedRunLauncher.forks([sys.executable, "-m", "dagster", "api", "execute_run", "{}"])
    assert not ForkedRunLauncher.forks(["/elsewhere/python", "-m", "dagster", "api", "execute_run", "{}"])


def test_changed_since_imported_looks_at_the_projects_files_only(tmp_path):
    own, later = tmp_path / "own.py", tmp_path / "later.py"
    own.write_text("A = 1\n")
    later.write_text("")
    installed = _module(Path(dg.__file__))  # an installed package's file, however new
    modules = {"own": _module(own), "later": _module(later), "dg": installed}
    assert run_worker.project_files(modules) == [str(own), str(later)]
    stamps = {str(own): (own.stat().st_mtime_ns, own.stat().st_size)}
    since = later.stat().st_mtime + 1  # `later` imported after the stamps, and not modified since
    assert run_worker.changed_since_imported(modules, stamps, since) is None
    own.write_text("A = 22\n")  # another size: changed, whatever its time says
    os.utime(own, ns=stamps[str(own)][:1] * 2)
    assert run_worker.changed_since_imported(modules, stamps, since) == str(own)
    assert run_worker.changed_since_imported({"later": _module(later)}, {}, since - 2) == str(later)  # modified after
    assert run_worker.changed_since_imported({"gone": _module(tmp_path / "gone.py")}, {}, 0) == str(tmp_path / "gone.py")


def _module(path: Path):
    module = type(sys)(path.stem)
    module.__file__ = str(path)
    return module


FALLBACK_SCRIPT = """
import sys
import dagster as dg
from batch_pipeline_tests.support.launched_jobs import quick_job

launcher = {"module": "batch_pipeline.defs.run_launcher", "class": "ForkedRunLauncher",
            "config": {"preload": ["broken_at_import"]}}
with dg.instance_for_test(temp_dir=sys.argv[1], overrides={"run_launcher": launcher}) as instance:
    origin = dg.reconstructable(quick_job).get_python_origin()
    run = instance.create_run_for_job(job_def=quick_job, job_code_origin=origin)
    instance.launch_run(run.run_id, workspace=None)
    instance.run_launcher.join(timeout=120)
    run = instance.get_run_by_id(run.run_id)
    print(run.status.value)
    for entry in instance.all_logs(run.run_id):
        print(entry.message)
"""


def test_a_fork_server_that_cannot_start_leaves_runs_to_new_processes(tmp_path):
    """A module the fork server imports raises at import (not an ImportError, which it would skip): the
    fork server dies, and each run starts as a new process instead, saying why. In a process of its own:
    the fork server is one per process."""
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('a bad setting, say')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    (tmp_path / "home").mkdir()
    done = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path / "home")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    status, *messages = done.stdout.splitlines()
    assert status == "SUCCESS", done.stdout + done.stderr[-3000:]
    assert any("Could not fork the run's worker from the warm process" in m for m in messages), messages
    assert not any(m.startswith("Run worker forked") for m in messages), messages

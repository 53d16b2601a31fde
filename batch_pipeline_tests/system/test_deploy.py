"""Tests for the production manifests in deploy/: they parse and agree with the code.

Covers: deploy/dagster.yaml (PostgreSQL from DAGSTER_POSTGRES_*, queued runs limited under
`concurrency:`, the GPU pool, run retries, telemetry off), the two Dockerfiles (vLLM's own image at
the version pyproject.toml pins, kernels fetched at build time, non-root USER, health check, the
gRPC command), docker-compose.yaml and .env.example (GPU
reservation, read-only model mount, health-gated start order, credentials only by reference, the
alert webhook's URL only in deploy/.env or a Secret),
deploy/workspace.yaml and the Helm values (entry module, the `batch_pipeline` location name, the run
pods that dagster-k8s's own K8sRunLauncher builds from them: `nvidia.com/gpu` = DATA_PARALLEL_SIZE x
TENSOR_PARALLEL_SIZE on tolerated GPU nodes for a run that loads its model, no GPU for a run on a warm
engine; the model PVC read-only, S3 credentials from a Secret), the Batch API in both (the compose service `batch-api` and the
`batchApi` values with the deploy/helm/batch-api chart that renders them: the command the CLI takes,
probes on paths the service answers, keys from a secret file, the same storage as the runs), the warm
engines (compose's `vllm-engine` and the `warmEngines` values with deploy/helm/warm-engines: their flags
equal to engine/server.py's `server_args` for the same settings, probes on /health, GPUs, the key from
a secret, ENGINE_URL naming them) and that every environment variable the manifests set is one the code
reads or a documented platform variable.

Does not build images, start containers, render the Helm chart or touch any service: YAML is read
with PyYAML, Dockerfiles with a small line parser; the run pods' Jobs are built by dagster-k8s and
handed to a stand-in Kubernetes API. Loading deploy/dagster.yaml into a real instance
is in test_postgres.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import yaml

from batch_pipeline.engine import placement
from batch_pipeline.config.settings import ENGINE_ENV, EngineSettings
from batch_pipeline_tests.support import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10; dagster depends on tomli
    import tomli as tomllib

DEPLOY = REPO / "deploy"
PACKAGE = REPO / "batch_pipeline"
LOCATION = "batch_pipeline"
ENTRY_MODULE = "batch_pipeline.definitions"
POSTGRES_ENV = {f"DAGSTER_POSTGRES_{k}" for k in ("USER", "PASSWORD", "HOSTNAME", "DB", "PORT")}

# Project settings outside ENGINE_ENV; each must still be read somewhere in the package (checked).
PROJECT_EXTRAS = {"S3_SSE", "S3_SSE_KMS_KEY_ID", "MAX_FAILED_LINE_RATE", "BATCH_PIPELINE_CACHE", "SHARDS",
                  "ALERT_WEBHOOK_URL", "GPU_RUN_K8S_CONFIG"}
# Set for the platform, not read by our code: Dagster, Python, pip, Hugging Face, vLLM.
PLATFORM_ENV = {
    "DAGSTER_HOME",
    "PATH",
    "VIRTUAL_ENV",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONUNBUFFERED",
    "PIP_NO_CACHE_DIR",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "DEBIAN_FRONTEND",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "VLLM_API_KEY",
    "VLLM_CACHE_ROOT",
}
# docker compose's own knobs (interpolated into docker-compose.yaml, never read by the code).
COMPOSE_ONLY = {"MODEL_HOST_DIR", "BATCH_PIPELINE_TAG", "DAGSTER_WEBSERVER_PORT", "GPUS", "BATCH_API_PORT"}
# The Batch API's settings (batch_pipeline/service/app.py); each must still be read there (checked).
API_ENV = {"BATCH_API_KEYS", "BATCH_API_KEYS_FILE", "BATCH_API_MAX_IN_FLIGHT", "BATCH_API_TENANT_LIMITS",
           "BATCH_API_MIN_EXPIRY_SECONDS", "DAGSTER_WEBSERVER_URL"}


# ----------------------------------------------------------------------------------- parsing


def load_yaml(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, f"{name} ends inside a continued line"
    return instructions


def exec_form(args: str) -> list[str]:
    """The JSON-array form of CMD/HEALTHCHECK CMD as a list."""
    return yaml.safe_load(args)


def dockerfile_env(name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in dockerfile(name):
        if keyword == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def env_file(name: str) -> dict[str, str]:
    """KEY=VALUE lines, commented-out ones included (`# KEY=...` documents an optional setting)."""
    found = {}
    for line in (DEPLOY / name).read_text().splitlines():
        m = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def uncommented(name: str) -> set[str]:
    """Names set on a live (not commented-out) line."""
    return {
        m.group(1)
        for line in (DEPLOY / name).read_text().splitlines()
        if (m := re.match(r"^([A-Z][A-Z0-9_]*)=", line.strip()))
    }


def compose() -> dict[str, Any]:
    return load_yaml("docker-compose.yaml")


def compose_interpolations() -> dict[str, str]:
    """${VAR...} references in docker-compose.yaml -> the operator after the name ('', ':-', ':?')."""
    text = (DEPLOY / "docker-compose.yaml").read_text()
    return {m.group(1): m.group(2) or "" for m in re.finditer(r"\$\{([A-Z][A-Z0-9_]*)(:[-?])?[^}]*\}", text)}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of `text` from `env`: ${VAR}, ${VAR:-default}, ${VAR:?error} and
    ${VAR:+replacement}, nested (an unset variable with no default is empty, as compose has it)."""
    out, i = [], 0
    while i < len(text):
        if not text.startswith("${", i):
            out.append(text[i])
            i += 1
            continue
        depth, j = 1, i + 2
        while depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        body = text[i + 2:j - 1]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?::([-?+])(.*))?", body, re.DOTALL)
        assert m, f"cannot interpolate ${{{body}}}"
        name, op, operand = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name, "")
        if op == "-":
            value = value or interpolate(operand, env)
        elif op == "?":
            assert value, f"compose would refuse to start: {operand}"
        elif op == "+":
            value = interpolate(operand, env) if value else ""
        out.append(value)
        i = j
    return "".join(out)


def helm() -> dict[str, Any]:
    return load_yaml("helm/values.yaml")


def helm_deployment() -> dict[str, Any]:
    (deployment,) = helm()["dagster-user-deployments"]["deployments"]
    return deployment


def helm_run_k8s() -> dict[str, Any]:
    return helm()["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]


def helm_jobs(monkeypatch, **env: str) -> ModuleType:
    """defs/jobs.py as the code server loads it: under the deployment's env of values.yaml (with `env`
    on top), run afresh as a module of its own, so the jobs imported elsewhere stay as they were."""
    for name in ("ENGINE_URL", "MODELS_FILE", "ENGINE_PRESET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**helm_deployment()["env"], **env}.items():
        if name != "BATCH_PIPELINE_CACHE":  # a path of the pod; nothing here needs it
            monkeypatch.setenv(name, value)
    from batch_pipeline.defs import jobs

    spec = importlib.util.spec_from_file_location("helm_jobs", jobs.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def helm_run_pod(run_tags: dict[str, str]) -> Any:
    """The pod spec of the Kubernetes Job that dagster-k8s's K8sRunLauncher (the chart's run launcher)
    creates for a run with these tags: the launcher configured as the chart renders `runLauncher` into
    the instance, the code server's container context as its `includeConfigInLaunchedRuns` renders it
    (dagster-user-deployments' k8sContainerContext helper), the Job caught by a stand-in for the API."""
    import dagster as dg
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster._core.test_utils import create_run_for_test
    from dagster_k8s import launcher as k8s_launcher

    config, deployment = helm()["runLauncher"]["config"]["k8sRunLauncher"], helm_deployment()
    run_k8s = {"container_config": config["runK8sConfig"]["containerConfig"],
               "pod_spec_config": config["runK8sConfig"]["podSpecConfig"]}
    batch_api = mock.MagicMock()
    with mock.patch.object(k8s_launcher, "load_kubernetes_config"):  # no cluster to read a config of
        run_launcher = k8s_launcher.K8sRunLauncher(
            service_account_name="batch-pipeline", instance_config_map="batch-pipeline-instance",
            dagster_home="/opt/dagster/dagster_home", job_namespace="batch-pipeline", load_incluster_config=True,
            image_pull_policy=config["imagePullPolicy"], volumes=config["volumes"],
            volume_mounts=config["volumeMounts"], run_k8s_config=run_k8s,
            k8s_client_batch_api=batch_api, k8s_client_core_api=mock.MagicMock())
    container_context = {"k8s": {
        "image_pull_policy": deployment["image"]["pullPolicy"], "namespace": "batch-pipeline",
        "env_config_maps": [f"batch-pipeline-{deployment['name']}-user-env"],
        "env_secrets": [s["name"] for s in deployment["envSecrets"]],
        "volumes": deployment["volumes"], "volume_mounts": deployment["volumeMounts"],
        "service_account_name": "batch-pipeline"}}
    origin = JobPythonOrigin("batch_file_job", RepositoryPythonOrigin(
        "python", ModuleCodePointer(ENTRY_MODULE, "defs", "/"), container_image="registry.example.internal/batch-pipeline:0.1.0",
        container_context=container_context))
    with dg.instance_for_test() as instance:
        run_launcher.register_instance(instance)
        run = create_run_for_test(instance, job_name="batch_file_job", job_code_origin=origin, tags=run_tags)
        run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    (job,) = [c.kwargs["body"] for c in batch_api.create_namespaced_job.call_args_list]
    return job.spec.template.spec


def gpus_of(pod: Any) -> dict[str, Any]:
    """Where a pod spec asks for GPUs: its container's GPU limit and request, its node selector's
    NVIDIA labels and its tolerations of the NVIDIA taint."""
    resources = pod.containers[0].resources
    return {"limit": (resources.limits or {}).get("nvidia.com/gpu"),
            "request": (resources.requests or {}).get("nvidia.com/gpu"),
            "nodes": {k: v for k, v in (pod.node_selector or {}).items() if k.startswith("nvidia.com/")},
            "tolerations": [t.key for t in pod.tolerations or [] if t.key == "nvidia.com/gpu"]}


def package_source() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))


# --------------------------------------------------------------------------- entry and location


def test_entry_module_exists_and_every_manifest_serves_it():
    assert importlib.util.find_spec(ENTRY_MODULE) is not None
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["dg"]["project"]["code_location_target_module"] == ENTRY_MODULE

    (cmd,) = [args for keyword, args in dockerfile("Dockerfile") if keyword == "CMD"]
    argv = exec_form(cmd)
    assert argv[:3] == ["dagster", "api", "grpc"]
    assert argv[argv.index("-m") + 1] == ENTRY_MODULE
    assert argv[argv.index("-h") + 1] == "0.0.0.0"
    assert helm_deployment()["dagsterApiGrpcArgs"] == ["-m", ENTRY_MODULE]


def test_location_name_is_the_same_everywhere():
    local = yaml.safe_load((REPO / "workspace.yaml").read_text())
    (local_entry,) = local["load_from"]
    assert local_entry["python_module"]["location_name"] == LOCATION

    (server,) = load_yaml("workspace.yaml")["load_from"]
    assert server["grpc_server"]["location_name"] == LOCATION

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["dg"]["project"]["code_location_name"] == LOCATION

    # The chart names the location after the deployment unless the workspace maps it explicitly;
    # a Service name cannot contain "_", so the explicit mapping must be there.
    workspace = helm()["dagsterWebserver"]["workspace"]
    assert workspace["enabled"] is True
    (helm_server,) = workspace["servers"]
    assert helm_server["name"] == LOCATION


def test_grpc_endpoints_point_at_the_code_server():
    (server,) = load_yaml("workspace.yaml")["load_from"]
    grpc = server["grpc_server"]
    services = compose()["services"]
    assert grpc["host"] in services
    argv = exec_form([a for k, a in dockerfile("Dockerfile") if k == "CMD"][0])
    assert grpc["port"] == int(argv[argv.index("-p") + 1])
    assert f"EXPOSE {grpc['port']}" in "\n".join(f"{k} {a}" for k, a in dockerfile("Dockerfile"))

    (helm_server,) = helm()["dagsterWebserver"]["workspace"]["servers"]
    deployment = helm_deployment()
    assert helm_server["host"] == deployment["name"]  # the chart's Service is named after the deployment
    assert helm_server["port"] == deployment["port"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", deployment["name"]), "not a valid Service name"


# ----------------------------------------------------------------------------- instance settings


def test_instance_yaml_uses_postgres_from_the_environment():
    instance = load_yaml("dagster.yaml")
    db = instance["storage"]["postgres"]["postgres_db"]
    refs = {db[field]["env"] for field in ("username", "password", "hostname", "db_name", "port")}
    assert refs == POSTGRES_ENV
    # SQLAlchemy 2.1 maps postgresql:// to psycopg 3, which dagster-postgres does not bring.
    assert db["scheme"] == "postgresql+psycopg2"


def test_instance_yaml_queues_runs_and_limits_the_gpu_pool():
    instance = load_yaml("dagster.yaml")
    assert instance["run_coordinator"]["class"] == "QueuedRunCoordinator"
    # Dagster's own loader: it refuses run-queue limits next to `concurrency:` and unknown fields.
    from dagster._core.instance.config import dagster_instance_config

    dagster_instance_config(str(DEPLOY))
    dagster_instance_config(str(REPO))
    # File runs take seconds on a warm engine: the queue is checked more often than Dagster's 5 s.
    assert instance["run_coordinator"]["config"]["dequeue_interval_seconds"] <= 2
    assert load_yaml("../dagster.yaml")["run_queue"]["dequeue_interval_seconds"] <= 2
    assert instance["concurrency"]["runs"]["max_concurrent_runs"] >= 1
    assert instance["concurrency"]["pools"]["default_limit"] == 1
    assert instance["run_retries"] == {"enabled": True, "max_retries": 2}
    assert instance["telemetry"] == {"enabled": False}


def test_the_inference_asset_is_in_the_pool_the_manifests_limit():
    from batch_pipeline.defs.assets import inference_results

    assert inference_results.op.pool == "gpu"
    pools = helm()["concurrency"]["pools"]
    assert helm()["concurrency"]["enabled"] is True
    assert pools["defaultLimit"] >= 1
    assert pools["granularity"] == "run"  # a run pod holds its GPUs from start to end


def test_runs_on_a_warm_engine_hold_no_gpu_pool_slot(monkeypatch, tmp_path):
    """The answering steps take the gpu pool when they load a model in their run; with every model on a
    warm engine (ENGINE_URL, a url per MODELS_FILE entry) they take none and runs answer side by side."""
    from batch_pipeline.defs.resources import answering_pool

    for var in ("ENGINE_URL", "MODELS_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert answering_pool() == "gpu"
    monkeypatch.setenv("ENGINE_URL", "http://engine:8000")
    assert answering_pool() is None
    models = tmp_path / "models.yaml"
    models.write_text("mini:\n  path: /models/mini\n")
    monkeypatch.setenv("MODELS_FILE", str(models))
    assert answering_pool() == "gpu"  # mini would load in the run's own process
    models.write_text("mini:\n  path: /models/mini\n  url: http://mini-engine:8000\n")
    assert answering_pool() is None
    monkeypatch.setenv("MODELS_FILE", str(tmp_path / "missing.yaml"))
    assert answering_pool() == "gpu"  # unreadable: the run says why; the pool is kept meanwhile


def test_a_slotless_run_builds_no_engine_of_its_own_beside_a_warm_engine_on_gpus(monkeypatch):
    """With every model warm the answering step holds no gpu slot; a line that still needs an engine in
    the run's process (embeddings, score) is then refused on a GPU machine, naming why (GPUs faked: none here)."""
    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.defs import resources

    monkeypatch.delenv("MODELS_FILE", raising=False)
    monkeypatch.setattr(resources, "gpu_count", lambda: 2)
    monkeypatch.setenv("ENGINE_URL", "http://engine:8000")
    with pytest.raises(ConfigError, match=r"holds no `gpu` pool slot, and this machine has GPUs"):
        resources.refuse_slotless_engine()
    monkeypatch.setattr(resources, "gpu_count", lambda: 0)
    resources.refuse_slotless_engine()  # CPUs: built in the run's process as before
    monkeypatch.setenv("GPU_RUN_K8S_CONFIG", json.dumps({"pod_spec_config": {"node_selector": {"gpu": "true"}}}))
    with pytest.raises(ConfigError, match=r"holds no `gpu` pool slot, so its Kubernetes pod is the run launcher's "
                                          r"GPU-free one"):
        resources.refuse_slotless_engine()  # a Kubernetes run pod on a warm engine: no GPU to load it on
    monkeypatch.delenv("GPU_RUN_K8S_CONFIG")
    monkeypatch.setattr(resources, "gpu_count", lambda: 2)
    monkeypatch.delenv("ENGINE_URL")
    resources.refuse_slotless_engine()  # in-process: the step holds the slot


def test_a_run_without_the_gpu_pod_tag_loads_no_model_in_a_gpu_less_pod(monkeypatch):
    """On Kubernetes (GPU_RUN_K8S_CONFIG set) a run that loads its model but was launched without the
    jobs' GPU tag (from the asset graph: __ASSET_JOB) has a pod without GPUs: refused before any model
    loads, saying where to launch it from (GPUs faked, as above)."""
    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.defs import resources

    for var in ("ENGINE_URL", "MODELS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPU_RUN_K8S_CONFIG", json.dumps({"pod_spec_config": {"node_selector": {"gpu": "true"}}}))
    monkeypatch.setattr(resources, "gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"the pod has no GPU.*__ASSET_JOB.*Jobs > batch_file_job"):
        resources.refuse_gpu_less_pod()
    monkeypatch.setenv("ENGINE_URL", "http://engine:8000")
    resources.refuse_gpu_less_pod()  # a warm engine's run: GPU-free by design (refuse_slotless_engine's case)
    monkeypatch.delenv("ENGINE_URL")
    monkeypatch.setattr(resources, "gpu_count", lambda: 8)
    resources.refuse_gpu_less_pod()  # launched from the job: its tag gave the pod its GPUs
    monkeypatch.delenv("GPU_RUN_K8S_CONFIG")
    monkeypatch.setattr(resources, "gpu_count", lambda: 0)
    resources.refuse_gpu_less_pod()  # no Kubernetes GPU pods to miss: a CPU machine, compose, a laptop


def test_helm_instance_settings():
    values = helm()
    daemon = values["dagsterDaemon"]
    assert daemon["runCoordinator"]["type"] == "QueuedRunCoordinator"
    assert daemon["runCoordinator"]["config"]["queuedRunCoordinator"]["maxConcurrentRuns"] is None
    assert values["concurrency"]["runs"]["maxConcurrentRuns"] >= 1
    assert daemon["runRetries"] == {"enabled": True, "maxRetries": 2}
    assert values["telemetry"] == {"enabled": False}
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"


# ----------------------------------------------------------------------------------- images


def test_gpu_image_is_vllms_own_image_for_the_pinned_version():
    instructions = dockerfile("Dockerfile")
    (arg_base,) = [a for k, a in instructions if k == "ARG" and a.startswith("VLLM_IMAGE=")]
    base = arg_base.split("=", 1)[1]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (vllm_pin,) = [d for d in pyproject["project"]["optional-dependencies"]["gpu"] if d.startswith("vllm==")]
    assert base == "vllm/vllm-openai:v" + vllm_pin.split("==")[1], (base, vllm_pin)
    assert ("FROM", "${VLLM_IMAGE}") in instructions
    runs = "\n".join(a for k, a in instructions if k == "RUN")
    assert "vllm download-kernels" in runs  # kernels fetched at build time, not at every pod start
    install = next(a for k, a in instructions if k == "RUN" and "'.[gpu]'" in a)
    # The engine of the image is pinned while our dependencies resolve: nothing of it is replaced.
    assert "--constraint /opt/vllm-image-constraints.txt" in install and "pip freeze" in install
    assert all(name in install for name in ("vllm", "torch", "triton", "flashinfer", "nvidia-"))
    assert [a for k, a in instructions if k == "ENTRYPOINT"] == ["[]"], "vLLM's `vllm serve` entrypoint is cleared"

    pins = dict(re.match(r"([\w-]+)==(.+)", d).groups() for d in pyproject["project"]["dependencies"] if "==" in d)
    assert f"dagster-k8s=={pins['dagster-postgres']}" in runs  # the integrations move together
    extras = pyproject["project"]["optional-dependencies"]
    assert f"dagster-k8s=={pins['dagster-postgres']}" in extras["k8s"] and f"dagster-k8s=={pins['dagster-postgres']}" in extras["test"]


def test_dagster_image_pins_match_the_project():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = {d for d in pyproject["project"]["dependencies"] if d.startswith("dagster")}
    runs = " ".join(a for k, a in dockerfile("Dockerfile.dagster") if k == "RUN")
    installed = set(re.findall(r"'(dagster[\w-]*==[\d.]+)'", runs))
    assert installed, runs
    assert installed <= pins, installed - pins


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.dagster"])
def test_images_run_as_a_non_root_user(name):
    users = [a for k, a in dockerfile(name) if k == "USER"]
    assert users, f"{name} has no USER"
    assert users[-1] not in ("root", "0", "0:0")
    uid_args = [a for k, a in dockerfile(name) if k == "ARG" and a.startswith("APP_UID=")]
    assert uid_args == ["APP_UID=10001"]  # the uid Helm's securityContext names


def test_kubernetes_pods_run_as_the_image_user():
    for context in (helm_deployment()["podSecurityContext"], helm_run_k8s()["podSpecConfig"]["securityContext"]):
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == 10001
    for context in (helm_deployment()["securityContext"], helm_run_k8s()["containerConfig"]["securityContext"]):
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]


def test_health_checks():
    (check,) = [a for k, a in dockerfile("Dockerfile") if k == "HEALTHCHECK"]
    argv = exec_form(check.split(" CMD ", 1)[1])
    assert argv == ["dagster", "api", "grpc-health-check", "-p", "4000"]
    services = compose()["services"]
    assert services["dagster-daemon"]["healthcheck"]["test"] == ["CMD", "dagster-daemon", "liveness-check"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.dagster"])
def test_build_context_holds_only_what_the_image_copies(name):
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile. Everything is excluded first,
    # so .venv, .cache (models), .git and deploy/.env (credentials) never reach the builder.
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    assert ignore[[i for i, line in enumerate(ignore) if not line.startswith("#")][0]] == "*"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert not {a for a in allowed if ".env" in a or a.startswith((".venv", ".cache", ".git"))}
    for keyword, args in dockerfile(name):
        if keyword == "COPY":
            sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
            assert set(sources) <= allowed, f"COPY {args}: not in the build context"


# ------------------------------------------------------------------------------------ compose


def test_compose_reserves_gpus_for_the_code_server_and_the_warm_engine_only():
    services = compose()["services"]
    for name in ("user-code", "vllm-engine"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert device["capabilities"] == ["gpu"]
        assert device["count"] == "${GPUS:-all}"  # the server's GPUs: ranks x TP of them per run
    for name in ("postgres", "dagster-webserver", "dagster-daemon", "batch-api"):
        assert "deploy" not in services[name]


def test_compose_start_order_and_exposure():
    services = compose()["services"]
    for name in ("dagster-webserver", "dagster-daemon", "user-code"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("dagster-webserver", "dagster-daemon"):
        assert services[name]["depends_on"]["user-code"]["condition"] == "service_healthy"
    assert "ports" not in services["postgres"]
    assert all(p.startswith("127.0.0.1:") for p in services["dagster-webserver"]["ports"])
    assert "postgres_data:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    for service in services.values():
        assert not service.get("privileged")
        assert service.get("user") not in ("root", "0")


def test_compose_mounts_the_model_read_only():
    mounts = compose()["services"]["user-code"]["volumes"]
    model_mounts = [m for m in mounts if ":/models" in m]
    assert model_mounts == ["${MODEL_HOST_DIR:?set MODEL_HOST_DIR in deploy/.env}:/models:ro"]
    assert dockerfile_env("Dockerfile")["MODEL_PATH"].startswith("/models/")
    assert env_file(".env.example")["MODEL_PATH"].startswith("/models/")


def test_compose_variables_are_documented_in_env_example():
    documented = env_file(".env.example")
    required_set = uncommented(".env.example")
    for name, operator in compose_interpolations().items():
        assert name in documented, f"${{{name}}} is used in docker-compose.yaml but not in .env.example"
        if operator == ":?":
            assert name in required_set, f"{name} is required by compose but commented out in .env.example"


def compose_engine_env(case: str) -> dict[str, str]:
    """The settings .env.example gives: its live lines, or every line uncommented (the optional ones too)."""
    documented = env_file(".env.example")
    names = uncommented(".env.example") if case == "live" else set(documented)
    return {name: documented[name] for name in names if documented[name]}


@pytest.mark.parametrize("case", ["live", "every documented setting"])
def test_compose_warm_engine_runs_the_server_engine_start_runs(case, monkeypatch):
    """The vllm-engine service's command is the one `batch-pipeline engine start` would run with the
    same .env (on GPUs, listening on every address): flags cannot drift from engine/server.py."""
    from batch_pipeline.config.settings import engine_settings_from_env
    from batch_pipeline.engine import engine_args, server

    monkeypatch.setattr(engine_args, "is_cpu", lambda: False)  # the container has GPUs; this machine may not
    env = compose_engine_env(case)
    settings = engine_settings_from_env(env)
    expected = ["python3", "-m", server.SERVER_MODULE,
                *server.server_args(settings, env["MODEL_PATH"], env["SERVED_MODEL_NAME"], "generate"),
                "--host", "0.0.0.0", "--port", "8000"]
    argv = shlex.split(interpolate(compose()["services"]["vllm-engine"]["command"], env))

    def same(a: str, b: str) -> bool:  # 0.90 in .env is the 0.9 the code formats
        try:
            return a == b or float(a) == float(b)
        except ValueError:
            return False

    assert len(argv) == len(expected) and all(map(same, argv, expected)), (argv, expected)
    if case != "live":  # the optional settings reach the server too
        assert {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"} <= set(argv)


def test_compose_warm_engine_is_health_checked_and_runs_wait_for_it():
    from urllib.parse import urlparse

    services = compose()["services"]
    engine, user_code = services["vllm-engine"], services["user-code"]
    argv = shlex.split(engine["command"])
    port = argv[argv.index("--port") + 1]
    assert engine["profiles"] == ["warm-engine"] and engine["image"] == user_code["image"]
    probe = " ".join(engine["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/health" in probe
    assert engine["healthcheck"]["interval"] == "10s"
    assert "ports" not in engine  # reached on the compose network only
    # The same read-only model folder as the runs; the model named by the same MODEL_PATH.
    model_mounts = [m for m in engine["volumes"] if ":/models" in m]
    assert model_mounts == [m for m in user_code["volumes"] if ":/models" in m]
    assert "${MODEL_PATH:?" in engine["command"] and "env_file" not in engine  # no storage keys in the engine
    # Runs execute in user-code: it starts once the engine answers /health (when the profile is on),
    # and .env points them at the service.
    assert user_code["depends_on"]["vllm-engine"] == {"condition": "service_healthy", "required": False}
    url = urlparse(env_file(".env.example")["ENGINE_URL"])
    assert url.hostname == "vllm-engine" and str(url.port) == port
    # The key: vLLM's VLLM_API_KEY from the ENGINE_API_KEY the runs send, never a literal.
    assert engine["environment"]["VLLM_API_KEY"] == "${ENGINE_API_KEY:-}"
    assert env_file(".env.example")["ENGINE_API_KEY"] == "" and "ENGINE_API_KEY" not in uncommented(".env.example")


def test_compose_database_settings_match_the_instance_yaml():
    services = compose()["services"]
    for name in ("user-code", "dagster-webserver", "dagster-daemon"):
        assert set(services[name]["environment"]) == POSTGRES_ENV
    assert services["dagster-webserver"]["environment"]["DAGSTER_POSTGRES_HOSTNAME"] == "postgres"


# --------------------------------------------------------------------------------------- helm


def test_helm_run_pods_request_one_gpu_per_engine_rank_and_tensor_parallel_slice(monkeypatch):
    """Without a warm engine, the pod dagster-k8s builds for a run of either job asks for
    DATA_PARALLEL_SIZE x TENSOR_PARALLEL_SIZE GPUs of the code server's env (another count when they
    change) on the GPU nodes, with GPU_RUN_K8S_CONFIG's CPUs and memory, and keeps what the launcher
    and the code server give every pod (/dev/shm, the cache and model mounts): the job's tag adds."""
    env = helm_deployment()["env"]
    tp, dp = int(env["TENSOR_PARALLEL_SIZE"]), int(env["DATA_PARALLEL_SIZE"])
    gpu_pod = json.loads(env["GPU_RUN_K8S_CONFIG"])
    jobs = helm_jobs(monkeypatch)
    for job in (jobs.batch_job, jobs.batch_file_job):
        pod = helm_run_pod(dict(job.run_tags))
        assert gpus_of(pod) == {"limit": str(dp * tp), "request": None, "tolerations": ["nvidia.com/gpu"],
                                "nodes": gpu_pod["pod_spec_config"]["node_selector"]}
        resources = pod.containers[0].resources
        assert resources.requests == gpu_pod["container_config"]["resources"]["requests"]
        assert resources.limits == {**gpu_pod["container_config"]["resources"]["limits"], "nvidia.com/gpu": str(dp * tp)}
        assert {m.name for m in pod.containers[0].volume_mounts} == {"dshm", "engine-cache", "models"}
    assert dp * tp >= 1
    # The same plan the run makes: it fits the GPUs the pod asks for.
    settings = EngineSettings(data_parallel_size=dp, tensor_parallel_size=tp)
    assert placement.placement_problem(settings, gpus=dp * tp) is None
    assert [p.gpus for p in placement.plan_ranks(settings, gpus=dp * tp, env={})][-1] == (str(dp * tp - 1),)
    two_by_two = helm_jobs(monkeypatch, DATA_PARALLEL_SIZE="2", TENSOR_PARALLEL_SIZE="2")
    assert gpus_of(helm_run_pod(dict(two_by_two.batch_file_job.run_tags)))["limit"] == "4"
    # Copied onto run pods by includeConfigInLaunchedRuns, code-server resources would override these.
    assert "resources" not in helm_deployment()


def test_helm_run_pods_of_runs_on_a_warm_engine_hold_no_gpu(monkeypatch, tmp_path):
    """With values.yaml's ENGINE_URL (commented out there) uncommented, and nothing else changed, the pod
    dagster-k8s builds for a run of either job has no GPU limit or request, no GPU node selector or
    toleration, and runK8sConfig's light CPU and memory. A MODELS_FILE model without a url loads in
    the run's pod again: its GPUs come back."""
    url = "http://warm-engine-8b-instruct-model:8000"
    assert f"# ENGINE_URL: {url}\n" in (DEPLOY / "helm" / "values.yaml").read_text()
    light = helm_run_k8s()["containerConfig"]["resources"]
    jobs = helm_jobs(monkeypatch, ENGINE_URL=url)
    for job in (jobs.batch_job, jobs.batch_file_job):
        pod = helm_run_pod(dict(job.run_tags))
        assert gpus_of(pod) == {"limit": None, "request": None, "nodes": {}, "tolerations": []}
        assert pod.containers[0].resources.requests == light["requests"]
        assert pod.containers[0].resources.limits == light["limits"]
    models = tmp_path / "models.yaml"
    models.write_text("mini:\n  path: /models/mini\n")
    jobs = helm_jobs(monkeypatch, ENGINE_URL=url, MODELS_FILE=str(models))
    assert gpus_of(helm_run_pod(dict(jobs.batch_file_job.run_tags)))["limit"] == "8"


def test_the_gpu_pod_tag_is_only_on_jobs_whose_runs_load_their_model_in_a_kubernetes_pod(monkeypatch):
    """run_pod_tags(): no tag without GPU_RUN_K8S_CONFIG (compose, a laptop: no pod to size) nor on a warm
    engine; with it, that config with nvidia.com/gpu = DATA_PARALLEL_SIZE x TENSOR_PARALLEL_SIZE (one
    written there is replaced); engine settings that cannot be read leave it as written (the run names
    them when it starts); a value that is not a JSON object of the tag's keys fails, naming the variable."""
    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.defs.jobs import run_pod_tags

    for var in ("ENGINE_URL", "MODELS_FILE", "ENGINE_PRESET", "GPU_RUN_K8S_CONFIG", "DATA_PARALLEL_SIZE",
                "TENSOR_PARALLEL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert run_pod_tags() == {}
    given = {"container_config": {"resources": {"limits": {"memory": "9Gi", "nvidia.com/gpu": "1"}}}}
    monkeypatch.setenv("GPU_RUN_K8S_CONFIG", json.dumps(given))
    monkeypatch.setenv("DATA_PARALLEL_SIZE", "2")
    monkeypatch.setenv("TENSOR_PARALLEL_SIZE", "3")
    limits = json.loads(run_pod_tags()["dagster-k8s/config"])["container_config"]["resources"]["limits"]
    assert limits == {"memory": "9Gi", "nvidia.com/gpu": "6"}
    monkeypatch.setenv("ENGINE_URL", "http://engine:8000")
    assert run_pod_tags() == {}
    monkeypatch.delenv("ENGINE_URL")
    monkeypatch.setenv("DATA_PARALLEL_SIZE", "two")
    assert json.loads(run_pod_tags()["dagster-k8s/config"]) == given
    monkeypatch.setenv("GPU_RUN_K8S_CONFIG", "{nope")
    with pytest.raises(ConfigError, match=r"GPU_RUN_K8S_CONFIG='\{nope' is not a valid JSON object"):
        run_pod_tags()
    monkeypatch.setenv("GPU_RUN_K8S_CONFIG", '{"containerConfig": {}}')
    with pytest.raises(ConfigError, match=r"GPU_RUN_K8S_CONFIG has containerConfig; its keys are container_config"):
        run_pod_tags()


def test_helm_run_pods_keep_the_engine_cache_on_a_claim():
    k8s = helm_run_k8s()
    launcher = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())["runLauncher"]["config"]["k8sRunLauncher"]
    volumes = {v["name"]: v for v in launcher["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in launcher["volumeMounts"]}
    assert volumes["engine-cache"]["persistentVolumeClaim"]["claimName"]
    assert mounts["engine-cache"] == helm_deployment()["env"]["BATCH_PIPELINE_CACHE"]
    assert k8s["containerConfig"]["resources"]["requests"]["cpu"]


def test_helm_code_server_reads_the_same_database_as_the_chart():
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    pg, env = values["postgresql"], helm_deployment()["env"]
    assert env["DAGSTER_POSTGRES_HOSTNAME"] == pg["postgresqlHost"]
    assert env["DAGSTER_POSTGRES_USER"] == pg["postgresqlUsername"]
    assert env["DAGSTER_POSTGRES_DB"] == pg["postgresqlDatabase"]
    assert env["DAGSTER_POSTGRES_PORT"] == str(pg["service"]["port"])
    assert all(isinstance(v, str) for v in env.values()), "the chart's env map takes strings"
    assert "DAGSTER_POSTGRES_PASSWORD" not in env  # the chart's DAGSTER_PG_PASSWORD (a Secret) stands in


def test_helm_run_launcher_gives_every_pod_no_gpu_and_a_dev_shm_in_memory():
    """runK8sConfig is every run pod's, and a job's tag can add a GPU to it but never take one away: it
    names no GPU, GPU node label or GPU taint (the GPU pods' placement is GPU_RUN_K8S_CONFIG's, on GPU
    nodes' NoSchedule taint); /dev/shm in memory, which vLLM's workers need, is the launcher's."""
    assert "nvidia.com" not in json.dumps(helm_run_k8s())
    placed = json.loads(helm_deployment()["env"]["GPU_RUN_K8S_CONFIG"])["pod_spec_config"]
    assert placed["node_selector"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in placed["tolerations"])
    launcher = helm()["runLauncher"]["config"]["k8sRunLauncher"]
    shm = {v["name"]: v for v in launcher["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in launcher["volumeMounts"]


def test_helm_model_volume_is_a_read_only_claim():
    deployment = helm_deployment()
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True  # run pods get the same mount
    volume = {v["name"]: v for v in deployment["volumes"]}["models"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    (mount,) = [m for m in deployment["volumeMounts"] if m["name"] == "models"]
    assert mount["mountPath"] == "/models" and mount["readOnly"] is True
    assert deployment["env"]["MODEL_PATH"].startswith("/models/")


def test_helm_credentials_come_from_secrets():
    values = helm()
    assert values["generatePostgresqlPasswordSecret"] is False
    assert values["global"]["postgresqlSecretName"]
    assert "postgresqlPassword" not in values["postgresql"]
    assert helm_deployment()["envSecrets"] == [{"name": "batch-pipeline-s3"}, {"name": "batch-pipeline-alerts"}]


def test_the_alert_webhook_is_a_secret_in_both_deploys():
    # A webhook URL holds a token: compose reads it from deploy/.env (ignored by git; the example
    # leaves it commented and empty), Helm from a Secret the code server's pod loads, which the
    # README has the operator create (empty: alerts off).
    assert env_file(".env.example")["ALERT_WEBHOOK_URL"] == "" and "ALERT_WEBHOOK_URL" not in uncommented(".env.example")
    assert compose()["services"]["user-code"]["env_file"]  # the code server, where the sensor runs, reads .env
    assert {"name": "batch-pipeline-alerts"} in helm_deployment()["envSecrets"]
    assert "ALERT_WEBHOOK_URL" not in helm_deployment()["env"]
    assert "create secret generic batch-pipeline-alerts" in (DEPLOY / "README.md").read_text()


# ------------------------------------------------------------------------------ the Batch API


def serve_routes() -> set[str]:
    """The paths `batch-pipeline serve` answers (the app built in-process; nothing is started)."""
    from batch_pipeline.service.app import Service, create_app
    from batch_pipeline.service.store import Store

    app = create_app(Service(Store("/nonexistent"), {"k" * 16: "t"}, "http://127.0.0.1:9"))
    return {route.path for route in app.routes}


def test_compose_runs_the_batch_api():
    from urllib.parse import urlparse

    from batch_pipeline.cli.main import build_parser

    spec = compose()
    services = spec["services"]
    api = services["batch-api"]
    args = build_parser().parse_args(api["command"][1:])  # the CLI takes the command as written
    assert api["command"][0] == "batch-pipeline" and (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    assert api["image"] == services["user-code"]["image"]  # the package's image; no GPUs reserved
    assert "deploy" not in api
    env = api["environment"]
    webserver = urlparse(env["DAGSTER_WEBSERVER_URL"])
    command = services["dagster-webserver"]["command"]
    assert webserver.hostname == "dagster-webserver" and webserver.port == int(command[command.index("-p") + 1])
    # Keys from a compose secret (a file ignored by git), never inline.
    (secret,) = api["secrets"]
    assert env["BATCH_API_KEYS_FILE"] == f"/run/secrets/{secret['target']}"
    assert spec["secrets"][secret["source"]]["file"] == "./batch-api-keys.txt"
    assert "batch-api-keys.txt" in (DEPLOY / ".gitignore").read_text().split()
    assert "BATCH_API_KEYS" not in env
    # The same storage as the runs (they read the uploads and write the results it serves).
    assert "batch_data:/data" in api["volumes"] and "batch_data:/data" in services["user-code"]["volumes"]
    assert api["env_file"] == services["user-code"]["env_file"]
    assert all(p.startswith("127.0.0.1:") and p.endswith(":8000") for p in api["ports"])
    probe = " ".join(api["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/health" in probe and "/health" in serve_routes()


def test_helm_runs_the_batch_api_with_probes_and_keys_from_a_secret():
    from urllib.parse import urlparse

    values = helm()
    api = values["batchApi"]
    routes = serve_routes()
    assert api["livenessProbe"]["httpGet"] == {"path": "/health", "port": api["port"]}
    assert api["readinessProbe"]["httpGet"] == {"path": "/ready", "port": api["port"]}
    assert {"/health", "/ready"} <= routes
    assert api["replicas"] >= 1 and api["service"]["port"] and api["service"]["type"] == "ClusterIP"
    env = api["env"]
    assert all(isinstance(v, str) for v in env.values()), "env values are strings"
    assert "BATCH_API_KEYS" not in env and "BATCH_API_KEYS_FILE" not in env  # the template mounts the Secret
    assert api["keysSecretName"] and api["envSecrets"] == helm_deployment()["envSecrets"][:1]  # S3, not alerts
    for name in ("STORAGE_INPUT_PATH", "STORAGE_OUTPUT_PATH"):
        assert env[name] == helm_deployment()["env"][name]
    # The dagster chart's webserver Service: <release>-webserver (release `batch-pipeline`, deploy/README.md).
    webserver = urlparse(env["DAGSTER_WEBSERVER_URL"])
    assert webserver.hostname == "batch-pipeline-webserver"
    assert webserver.port == values["dagsterWebserver"]["service"].get("port", 80)
    assert api["image"]["repository"] == helm_deployment()["image"]["repository"]
    assert api["podSecurityContext"]["runAsUser"] == 10001 and api["podSecurityContext"]["runAsNonRoot"] is True
    assert api["securityContext"]["allowPrivilegeEscalation"] is False

    # The chart that renders the section: every value it reads is there; the keys file is the Secret's.
    templates = "\n".join(p.read_text() for p in (DEPLOY / "helm" / "batch-api" / "templates").glob("*.yaml"))
    for reference in set(re.findall(r"\$api\.([A-Za-z_.]+)", templates)):
        node: Any = api
        for part in reference.split("."):
            assert isinstance(node, dict) and part in node, f"batchApi.{reference} is read by the chart but not set"
            node = node[part]
    keys_file = re.search(r"name: BATCH_API_KEYS_FILE\s+value: (\S+)", templates).group(1)
    mount = re.search(r"- name: keys\s+mountPath: (\S+)", templates).group(1)
    item = re.search(r"- key: keys\s+path: (\S+)", templates).group(1)
    assert keys_file == f"{mount}/{item}"
    assert '"serve", "--host", "0.0.0.0", "--port", "{{ $api.port }}"' in templates
    chart = yaml.safe_load((DEPLOY / "helm" / "batch-api" / "Chart.yaml").read_text())
    assert chart["name"] == "batch-api" and chart["apiVersion"] == "v2"


# --------------------------------------------------------------------------- warm engines (Helm)


def warm_engine_templates() -> str:
    return "\n".join(p.read_text() for p in (DEPLOY / "helm" / "warm-engines" / "templates").glob("*.yaml"))


def test_helm_warm_engine_runs_the_server_engine_start_runs_for_the_code_servers_settings(monkeypatch):
    """The first engine serves the default model with the flags `batch-pipeline engine start` gives
    the code server's (and so the run pods') env: what a run would load in-process, warm."""
    from batch_pipeline.config.settings import engine_settings_from_env
    from batch_pipeline.engine import engine_args, server

    monkeypatch.setattr(engine_args, "is_cpu", lambda: False)  # the engine pods have GPUs
    env = helm_deployment()["env"]
    settings = engine_settings_from_env(env)
    expected = server.server_args(settings, env["MODEL_PATH"], env["SERVED_MODEL_NAME"], "generate")
    assert helm()["warmEngines"]["engines"][0]["args"] == expected
    templates = warm_engine_templates()
    assert f'command: ["python3", "-m", "{server.SERVER_MODULE}"]' in templates
    assert '- "--host"\n            - "0.0.0.0"\n            - "--port"\n            - "{{ $we.port }}"' in templates


def test_helm_warm_engines_ask_for_their_gpus_and_are_probed_on_health():
    values = helm()
    we = values["warmEngines"]
    names = [engine["name"] for engine in we["engines"]]
    assert len(set(names)) == len(names)
    for engine in we["engines"]:
        args = engine["args"]
        service = f"warm-engine-{engine['name']}"  # a Service name: a DNS-1035 label
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", service) and len(service) <= 63, service
        assert "--host" not in args and "--port" not in args and "--api-key" not in args  # the template's; the key from a Secret
        gpus = int(args[args.index("--tensor-parallel-size") + 1]) * int(args[args.index("--data-parallel-size") + 1])
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert we[probe]["httpGet"] == {"path": "/health", "port": we["port"]}
    assert we["readinessProbe"]["periodSeconds"] == 10
    startup = we["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # an 8B model loads for minutes
    # The GPU nodes of the run pods that load their model; the user and claims of every run pod.
    placed = json.loads(helm_deployment()["env"]["GPU_RUN_K8S_CONFIG"])["pod_spec_config"]
    assert we["nodeSelector"] == placed["node_selector"] and we["tolerations"] == placed["tolerations"]
    pod = helm_run_k8s()["podSpecConfig"]
    assert we["podSecurityContext"] == pod["securityContext"]
    assert we["securityContext"] == helm_run_k8s()["containerConfig"]["securityContext"]
    models = {v["name"]: v for v in helm_deployment()["volumes"]}["models"]["persistentVolumeClaim"]
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    cache = {v["name"]: v for v in launcher["volumes"]}["engine-cache"]["persistentVolumeClaim"]
    assert we["modelsClaimName"] == models["claimName"] and we["cacheClaimName"] == cache["claimName"]
    assert we["image"]["repository"] == helm_deployment()["image"]["repository"]


def test_helm_warm_engine_chart_reads_only_values_that_are_set_and_run_pods_can_find_it():
    from urllib.parse import urlparse

    we = helm()["warmEngines"]
    templates = warm_engine_templates()
    for reference in set(re.findall(r"\$we\.([A-Za-z_.]+)", templates)):
        node: Any = we
        for part in reference.split("."):
            assert isinstance(node, dict) and part in node, f"warmEngines.{reference} is read by the chart but not set"
            node = node[part]
    for engine in we["engines"]:
        for reference in set(re.findall(r"\$engine\.([A-Za-z_]+)", templates)):
            assert reference in engine, f"warmEngines.engines[].{reference} is read by the chart but not set"
    assert "{{ $.Release.Name }}-{{ $engine.name }}" in templates  # the Service a URL names
    assert "readOnly: true" in templates and "nvidia.com/gpu" not in templates  # GPUs from each engine's resources
    assert "key: ENGINE_API_KEY" in templates and "name: VLLM_API_KEY" in templates
    chart = yaml.safe_load((DEPLOY / "helm" / "warm-engines" / "Chart.yaml").read_text())
    assert chart["name"] == "warm-engines" and chart["apiVersion"] == "v2"
    # Run pods get ENGINE_URL from the code server's env (commented out: installing the engine is a
    # choice); it names the first engine's Service as the README installs it (release warm-engine).
    values_text = (DEPLOY / "helm" / "values.yaml").read_text()
    url = urlparse(re.search(r"^\s*# ENGINE_URL: (\S+)$", values_text, re.MULTILINE).group(1))
    assert url.hostname == f"warm-engine-{we['engines'][0]['name']}" and url.port == we["port"]
    assert "helm upgrade --install warm-engine deploy/helm/warm-engines" in (DEPLOY / "README.md").read_text()


# ------------------------------------------------------------------------- environment variables


def manifest_env_names() -> dict[str, set[str]]:
    """Every variable a manifest sets in a container or the operator sets in .env, by file."""
    services = compose()["services"]
    names = {
        "Dockerfile": set(dockerfile_env("Dockerfile")),
        "Dockerfile.dagster": set(dockerfile_env("Dockerfile.dagster")),
        "docker-compose.yaml": {
            name
            for service, spec in services.items()
            if service != "postgres"
            for name in spec.get("environment", {})
        }
        | set(compose_interpolations()),
        ".env.example": set(env_file(".env.example")),
        "helm/values.yaml": set(helm_deployment()["env"]),
        "helm/values.yaml (batchApi)": set(helm()["batchApi"]["env"]),
    }
    return names


def test_manifest_variables_are_settings_the_code_reads():
    source = package_source()
    storage_names = set(re.findall(r"\b(STORAGE_[A-Z_]+)\b", source))
    assert storage_names == {"STORAGE_INPUT_PATH", "STORAGE_OUTPUT_PATH"}
    for name in PROJECT_EXTRAS | API_ENV:
        assert name in source, f"{name} is allowed in manifests but no longer read by the package"
    allowed = set(ENGINE_ENV) | storage_names | POSTGRES_ENV | PROJECT_EXTRAS | API_ENV | PLATFORM_ENV | COMPOSE_ONLY
    for path, names in manifest_env_names().items():
        unknown = {n for n in names if n not in allowed and not n.startswith("AWS_")}
        assert not unknown, f"{path} sets variables the code does not read: {sorted(unknown)}"


def test_postgres_service_is_created_from_the_same_variables():
    env = compose()["services"]["postgres"]["environment"]
    assert env["POSTGRES_USER"].startswith("${DAGSTER_POSTGRES_USER")
    assert env["POSTGRES_PASSWORD"].startswith("${DAGSTER_POSTGRES_PASSWORD")
    assert env["POSTGRES_DB"].startswith("${DAGSTER_POSTGRES_DB")


# ------------------------------------------------------------------------------ no secrets


SECRET_NAME = re.compile(r"password|secret|token(?!s)|private[_-]?key", re.IGNORECASE)  # not ..._TOKENS
# Names of Kubernetes Secret objects, or switches about them: not secrets themselves.
SECRET_REFERENCE = re.compile(r"(SecretName|^generate\w*Secret)$")
SECRET_VALUE = [
    re.compile(r"AKIA[0-9A-Z]{16}"),  # AWS access key id
    re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"),  # AWS secret access key shape
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
]
MANIFESTS = [
    "dagster.yaml",
    "workspace.yaml",
    "docker-compose.yaml",
    ".env.example",
    "Dockerfile",
    "Dockerfile.dagster",
    "helm/values.yaml",
    "README.md",
]


def walk(node: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [item for k, v in node.items() for item in walk(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [item for i, v in enumerate(node) for item in walk(v, f"{path}[{i}]")]
    return [(path, node)]


@pytest.mark.parametrize("name", MANIFESTS)
def test_no_secret_looking_values(name):
    text = (DEPLOY / name).read_text()
    for pattern in SECRET_VALUE:
        match = pattern.search(text)
        assert match is None, f"{name}: {match.group(0)[:8]}... looks like a credential"


@pytest.mark.parametrize("name", ["dagster.yaml", "docker-compose.yaml", "helm/values.yaml"])
def test_secret_fields_hold_references_only(name):
    for path, value in walk(load_yaml(name)):
        leaf = path.rsplit(".", 1)[-1]
        if not SECRET_NAME.search(leaf) or SECRET_REFERENCE.search(leaf) or value in (None, "", False):
            continue
        # ${VAR} interpolation (compose) or {env: VAR} (dagster.yaml, where the leaf is "env").
        assert isinstance(value, str) and value.startswith("${"), f"{name}: {path} = literal value"


def test_env_example_leaves_secrets_empty():
    for key, value in env_file(".env.example").items():
        if SECRET_NAME.search(key):
            assert value == "", f".env.example: {key} must be left empty"
    assert ".env" in (DEPLOY / ".gitignore").read_text().split()


@pytest.mark.slow
def test_definitions_load_from_an_installed_package_without_the_source_tree(tmp_path):
    """The image installs the package (no pyproject.toml beside it): load_from_defs_folder must still
    find the project, from the dg.toml shipped inside the package, and load every definition."""
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "batch_pipeline", site / "batch_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    script = (
        "import batch_pipeline\n"
        "print(batch_pipeline.__file__)\n"
        "from batch_pipeline.definitions import defs\n"
        "d = defs()\n"
        "print(sorted(k.to_user_string() for k in d.resolve_asset_graph().get_all_asset_keys()))\n"
        "print(sorted(s.name for s in d.sensors), [s.name for s in d.schedules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(str(site / "batch_pipeline"))  # the copy, not the editable source tree
    assert "['batch_files', 'batch_outputs', 'inference_results', 'throughput_metrics', 'validated_requests']" in proc.stdout
    assert "['batch_upload_sensor', 'date_figures_sensor', 'file_partitions_sensor', 'run_failure_alert_sensor'] ['nightly_batch_schedule']" in proc.stdout
    assert "dg.toml" in (REPO / "pyproject.toml").read_text()  # shipped as package data

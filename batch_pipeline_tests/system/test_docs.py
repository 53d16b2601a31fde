"""The documentation against the code: settings and their defaults, links, the module map, doctor.

Covers: docs/CONFIGURATION.md names every environment variable the package reads (ENGINE_ENV and its
old names, the settings functions, and every name read through base/env.py's readers (`read_text`,
`read_choice`, `read_checked`, `int_in_range`, `number_in_range`), `os.environ` or `EnvVar` anywhere
under batch_pipeline/) and no other, apart from a short list that the libraries underneath read, kept
in a table of its own; base/env.py is the one way in (no other module reads `os.environ` but the
few listed in DIRECT_ENVIRON, each saying why it is not a setting read) and each variable is read in
one module; every default stated there
is the code's (EngineSettings' field defaults, the engine arguments filled in on CPU, constants, and
the settings functions called with an empty environment), never a copy kept in this file. Every
relative link and `#anchor` in README.md, docs/*.md, deploy/README.md and bench/README.md resolves to
a file, and a heading in it, inside the repository. README.md stays a front door (at most 200 lines,
`make` targets that exist); docs/DEVELOPMENT.md's module table lists every module, and the layers
README.md draws are the ones the imports keep (each name imports only those on the lines below it,
never one beside it on its own line); docs/OPERATIONS.md
lists every doctor check. The test tree mirrors the package: every test file in the folder of a
layer (a folder or top-level module of batch_pipeline/) or in system/, helpers only in support/. deploy/'s manifests are checked by test_deploy.py, not here.

Touches nothing outside tmp_path: reads files and imports modules. No engine, no storage, no Dagster
instance, no network (the Batch API's defaults come from building its service object in memory).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from batch_pipeline.config import settings as settings_module
from batch_pipeline.config.settings import ENGINE_ENV, ENGINE_ENV_ALIASES, EngineSettings
from batch_pipeline_tests.support import REPO

PACKAGE = REPO / "batch_pipeline"
DOCS = REPO / "docs"
TESTS = REPO / "batch_pipeline_tests"
CONFIGURATION = DOCS / "CONFIGURATION.md"
MARKDOWN = [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "deploy" / "README.md", REPO / "bench" / "README.md"]
README_MAX_LINES = 200

# Read on the package's behalf by the libraries underneath (boto3, Dagster's instance file
# deploy/dagster.yaml, vLLM, libgomp), not by its own code: documented in their own table.
LIBRARY_SECTION = "Read by the libraries underneath"
LIBRARY_ENV = {
    "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
    "DAGSTER_POSTGRES_USER", "DAGSTER_POSTGRES_PASSWORD", "DAGSTER_POSTGRES_HOSTNAME", "DAGSTER_POSTGRES_DB",
    "DAGSTER_POSTGRES_PORT",
    "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_WAIT_POLICY",
}
NAME = r'"([A-Z][A-Z0-9_]+)"'
# How the package reads a variable by a literal name: base/env.py's readers (the one way in), and
# os.environ where DIRECT_ENVIRON allows it; a write (`os.environ["X"] = ...`) is not a read.
READS = [
    re.compile(r"\b(?:read_text|read_choice|read_checked|int_in_range|number_in_range)\(\s*[\w.]+,\s*" + NAME),
    re.compile(r"os\.environ\.get\(\s*" + NAME),
    re.compile(r"os\.environ\[\s*" + NAME + r"\s*\](?!\s*=[^=])"),
    re.compile(r"EnvVar\(\s*" + NAME),
]
# The modules that touch os.environ other than through base/env.py, and why none of them reads a
# setting of its own there.
DIRECT_ENVIRON = {
    "base/runtime.py": "sets vLLM's and Hugging Face's defaults for this process (setdefault), reads none",
    "cli/main.py": "quiets vLLM's log lines for `batch-pipeline run` (setdefault)",
    "cli/model_commands.py": "the same for `batch-pipeline model verify`",
    "engine/ranks.py": "sets a rank process's own environment (its devices) before vLLM loads",
    "engine/rank_server.py": "keeps the run's OMP_NUM_THREADS while the ranks' fork server imports with one "
                             "thread, and gives it back to each rank",
    "engine/server.py": "hands the whole environment to vLLM's server process",
    "cli/doctor.py": "lends DAGSTER_PG_PASSWORD (Helm's name) as DAGSTER_POSTGRES_PASSWORD while it loads "
                 "Dagster's instance, then takes it back",
}


# ----------------------------------------------------------------------------------- markdown


def without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept): no headings or links in them."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return "\n".join(lines)


def split_row(line: str) -> list[str]:
    """The cells of a table row; a `|` inside backticks stays in its cell."""
    cells, cell, code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            cells.append(cell.strip())
            cell = ""
            continue
        cell += char
    return [*cells, cell.strip()]


class Row(NamedTuple):
    section: str  # the `## ` heading above its table
    cells: list[str]

    @property
    def names(self) -> list[str]:
        return re.findall(r"`([A-Z][A-Z0-9_]+)`", self.cells[0])


def table_rows(path: Path, first_header: str) -> list[Row]:
    """The body rows of every table in `path` whose first header cell is `first_header`."""
    rows: list[Row] = []
    section, header = "", None
    for line in without_code_blocks(path.read_text()).splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = split_row(line)
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: ") and header[0].lower() == first_header:
            rows.append(Row(section, cells))
    return rows


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped but `-` and `_`, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in without_code_blocks(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "``", without_code_blocks(path.read_text()))
    return LINK.findall(text)


# ------------------------------------------------------------------------- variables the code reads


class RecordingEnv(dict):
    """An empty environment that remembers every name asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.asked.add(key)
        return super().__contains__(key)


def variable_readers() -> dict[str, set[str]]:
    """{variable: the modules that read it}: by literal name anywhere in the package's source, plus
    what config/settings.py's functions ask an environment for (names kept in tables, ENGINE_ENV)."""
    readers: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        for pattern in READS:
            for name in pattern.findall(source):
                readers.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    asked = set(ENGINE_ENV) | set(ENGINE_ENV_ALIASES)
    for name, function in vars(settings_module).items():
        if name.endswith("_from_env") and callable(function):
            env = RecordingEnv()
            function(env)
            asked.update(env.asked)
    for name in asked:
        readers.setdefault(name, set()).add("config/settings.py")
    return readers


def code_variables() -> set[str]:
    """Every environment variable the package reads."""
    return set(variable_readers())


def config_rows() -> list[Row]:
    return table_rows(CONFIGURATION, "variable")


def test_the_scan_finds_variables_read_in_each_way():
    found = code_variables()
    # One of each way of reading: read_text, read_choice, read_checked, int_in_range, number_in_range,
    # os.environ.get (DIRECT_ENVIRON), a name asked for by a settings function only (the run
    # priorities), ENGINE_ENV, an old name.
    assert {"STORAGE_INPUT_PATH", "DAGSTER_WEBSERVER_URL", "S3_SSE", "NIGHTLY_CRON", "MAX_LINE_BYTES",
            "AWS_READ_TIMEOUT", "DAGSTER_PG_PASSWORD", "SCHEDULE_RUN_PRIORITY", "ORDER", "SHARD_SIZE",
            "ENGINE_PRESET"} <= found
    assert "VLLM_LOGGING_LEVEL" not in found  # only set by the CLI (setdefault), never read


def _touches_environ(tree: ast.AST) -> bool:
    """Whether a module uses os.environ or os.getenv (by `os.` or imported from os)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and isinstance(node.value, ast.Name)
                and node.value.id == "os"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & {"environ", "getenv"}:
            return True
    return False


def test_settings_come_in_one_way_each_variable_read_in_one_module():
    touching = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                      if _touches_environ(ast.parse(p.read_text())))
    unexplained = [name for name in touching if name not in DIRECT_ENVIRON and name != "base/env.py"]
    assert not unexplained, (f"{unexplained} read os.environ: read a setting through base/env.py's readers "
                             "(or say in DIRECT_ENVIRON why it is not a setting read)")
    twice = {name: sorted(modules) for name, modules in variable_readers().items() if len(modules) > 1}
    assert not twice, f"read in more than one module (give each variable one settings function): {twice}"


def test_the_one_way_in_catches_a_module_reading_the_environment_itself():
    assert _touches_environ(ast.parse('import os\nx = os.environ.get("X")'))
    assert _touches_environ(ast.parse('from os import getenv\nx = getenv("X")'))
    assert not _touches_environ(ast.parse('from batch_pipeline.base.env import read_text\nx = read_text(None, "X")'))


def test_configuration_names_every_variable_the_code_reads_and_no_other():
    code = code_variables()
    rows = config_rows()
    documented = {name for row in rows for name in row.names}
    library = {name for row in rows if row.section == LIBRARY_SECTION for name in row.names}
    problems = [f"a row names no `VARIABLE`: {row.cells[0]!r}" for row in rows if not row.names]
    missing = sorted(code - documented - set(ENGINE_ENV_ALIASES))
    if missing:
        problems.append(f"read by the package but not in a table: {missing}")
    for old, new in ENGINE_ENV_ALIASES.items():
        if not any(new in row.names and f"`{old}`" in " ".join(row.cells) for row in rows):
            problems.append(f"{old}, still read for {new}, is not mentioned in {new}'s row")
    if library != LIBRARY_ENV:
        problems.append(f"the table '{LIBRARY_SECTION}' and LIBRARY_ENV differ: {sorted(library ^ LIBRARY_ENV)}")
    if library & code:
        problems.append(f"the package reads {sorted(library & code)}: move them to its own tables")
    unknown = sorted(documented - code - library)
    if unknown:
        problems.append(f"documented, but nothing reads them: {unknown}")
    # A library's variable is documented because something here uses it: the package's source, a
    # deployment manifest or the test suite's set-up.
    used = "\n".join(p.read_text() for p in [*PACKAGE.rglob("*.py"), TESTS / "conftest.py", *(TESTS / "support").glob("*.py")])
    used += "\n".join(p.read_text() for p in (REPO / "deploy").rglob("*") if p.is_file() and p.suffix != ".md")
    unused = sorted(name for name in LIBRARY_ENV if name not in used)
    if unused:
        problems.append(f"in LIBRARY_ENV but used nowhere in the package, deploy/, conftest.py or support/: {unused}")
    assert not problems, "docs/CONFIGURATION.md:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------- defaults


UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def stated_default(cell: str) -> tuple[bool, Any]:
    """(True, value) when a default cell states a value: `literal`, a number (with a unit), on/off;
    (False, None) when it describes one instead ("none", "vLLM's default", "the model's")."""
    cell = cell.strip()
    if match := re.match(r"`([^`]*)`", cell):
        return True, match.group(1)
    if match := re.match(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB)\b", cell):
        return True, float(match.group(1)) * UNITS[match.group(2)]
    if match := re.match(r"\d+(?:\.\d+)?", cell):
        return True, match.group(0)
    if match := re.match(r"(on|off)\b", cell):
        return True, match.group(1)
    return False, None


def same(code: Any, stated: Any) -> bool:
    if isinstance(code, bool):
        return {"on": True, "true": True, "off": False, "false": False}.get(str(stated).lower()) is code
    if isinstance(code, (int, float)):
        return float(stated) == float(code)
    if isinstance(code, Path):
        return Path(str(stated)).expanduser().absolute() == code
    if isinstance(code, dict):
        return json.loads(stated) == code
    return str(stated) == str(code)


@pytest.fixture
def code_defaults(monkeypatch, tmp_path) -> dict[str, Any]:
    """Each variable's default as the code has it: EngineSettings' fields, what engine_args fills in
    on CPU where a field is None, the settings functions with nothing set, and the constants."""
    from batch_pipeline.defs import assets, partitions, schedules
    from batch_pipeline.engine import engine_args
    from batch_pipeline.config import models
    from batch_pipeline.steps.validation import ValidationSettings
    from batch_pipeline.service import app

    defaults: dict[str, Any] = {}
    for field in dataclasses.fields(EngineSettings):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        defaults.update({var: default for var, attr in ENGINE_ENV.items() if attr == field.name})
    monkeypatch.setattr(engine_args, "is_cpu", lambda: True)  # no torch import: the CPU defaults
    cpu = engine_args.engine_kwargs(EngineSettings(), "model", "model", "generate")
    defaults["ENABLE_PREFIX_CACHING"] = cpu["enable_prefix_caching"]
    defaults["KV_CACHE_MEMORY_BYTES"] = cpu["kv_cache_memory_bytes"]

    sensor = settings_module.sensor_settings_from_env({})
    where = settings_module.storage_settings_from_env({})
    limits = ValidationSettings(served_model_name="model")
    for name in ("BATCH_PIPELINE_CACHE", "DAGSTER_WEBSERVER_URL", "BATCH_API_MAX_FILE_BYTES", "BATCH_API_MAX_FILE_REQUESTS",
                 "BATCH_API_MAX_IN_FLIGHT", "BATCH_API_TENANT_LIMITS", "BATCH_API_MIN_EXPIRY_SECONDS",
                 "BATCH_API_COMPLETION_WINDOWS", "BATCH_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    s3 = settings_module.s3_settings_from_env({})
    monkeypatch.setenv("HOME", str(tmp_path))  # cache_root() creates its folder: here, not in ~
    monkeypatch.setenv("BATCH_API_KEYS", "docs-test:" + "k" * 16)
    monkeypatch.setenv("STORAGE_OUTPUT_PATH", str(tmp_path / "output"))
    service = app.service_from_env()
    defaults.update({
        "STORAGE_INPUT_PATH": Path(where.input_path),
        "STORAGE_OUTPUT_PATH": Path(where.output_path),
        "AWS_MAX_ATTEMPTS": s3.max_attempts,
        "AWS_RETRY_MODE": s3.retry_mode,
        "AWS_CONNECT_TIMEOUT": s3.connect_timeout,
        "AWS_READ_TIMEOUT": s3.read_timeout,
        "MAX_LINE_BYTES": limits.max_line_bytes,
        "MAX_CUSTOM_ID_LENGTH": limits.max_custom_id_length,
        "MAX_FAILED_LINE_RATE": assets.DEFAULT_MAX_FAILED_RATE,
        "PARTITIONS_START": partitions.DEFAULT_PARTITIONS_START,
        "NIGHTLY_CRON": schedules.nightly_cron_from_env({}),
        "SHARDS": settings_module.shards_from_env({}),
        "SENSOR_INTERVAL_SECONDS": settings_module.sensor_interval_from_env({}),
        "ALERT_INTERVAL_SECONDS": settings_module.alert_interval_from_env({}),
        "SENSOR_WINDOW_DAYS": sensor.window_days,
        "SENSOR_BACKLOG": sensor.backlog,
        "SENSOR_MAX_RUNS_PER_TICK": sensor.max_runs_per_tick,
        "SCHEDULE_RUN_PRIORITY": settings_module.schedule_run_priority_from_env({}),
        "SENSOR_RUN_PRIORITY": settings_module.sensor_run_priority_from_env({}),
        "INPUT_QUEUE_URL": sensor.queue_url,
        "INPUT_QUEUE_VISIBILITY_SECONDS": sensor.queue_visibility_seconds,
        "BATCH_PIPELINE_CACHE": models.cache_root(),
        "DAGSTER_WEBSERVER_URL": service.dagster_url,
        "BATCH_API_MAX_FILE_BYTES": service.max_file_bytes,
        "BATCH_API_MAX_FILE_REQUESTS": service.max_file_requests,
        "BATCH_API_MAX_IN_FLIGHT": service.max_in_flight,
        "BATCH_API_MIN_EXPIRY_SECONDS": service.min_expiry,
    })
    from batch_pipeline.io import images

    image = images.image_settings_from_env({})
    defaults.update({
        "MAX_IMAGE_BYTES": image.max_image_bytes,
        "MAX_IMAGE_PIXELS": image.max_image_pixels,
        "MAX_IMAGES_PER_REQUEST": image.max_images_per_request,
        "IMAGE_FETCH_CONCURRENCY": image.concurrency,
        "IMAGE_FETCH_TIMEOUT": image.timeout_seconds,
    })
    return defaults


def test_every_stated_default_is_the_codes(code_defaults):
    checked, wrong = set(), []
    for row in config_rows():
        if row.section == LIBRARY_SECTION:
            continue
        if not row.names:
            continue  # reported by the test above
        states, value = stated_default(row.cells[1])
        names = ", ".join(row.names)
        code = code_defaults.get(row.names[0], None) if len(row.names) == 1 else None
        if len(row.names) > 1 or row.names[0] not in code_defaults or code is None or code == "":
            if states:  # a value the code does not have, or one this test cannot find there
                wrong.append(f"{names}: the docs state {value!r}, the code has no such default ({code!r})"
                             + ("; give each variable its own row" if len(row.names) > 1 else ""))
        elif not states:
            wrong.append(f"{names}: the code's default is {code!r}; state it in the default column")
        elif not same(code, value):
            wrong.append(f"{names}: the docs state {value!r}, the code has {code!r}")
        else:
            checked.add(names)
    assert not wrong, "docs/CONFIGURATION.md's defaults out of step with the code:\n" + "\n".join(wrong)
    assert {"CHECKPOINT_ANSWERS", "CHECKPOINT_SECONDS", "SEED", "GPU_MEMORY_UTILIZATION", "ORDER", "DTYPE",
            "KV_CACHE_MEMORY_BYTES", "ENABLE_PREFIX_CACHING", "SENSOR_INTERVAL_SECONDS", "SENSOR_WINDOW_DAYS",
            "SENSOR_BACKLOG", "SENSOR_MAX_RUNS_PER_TICK", "INPUT_QUEUE_VISIBILITY_SECONDS", "SHARDS",
            "MAX_LINE_BYTES", "MAX_CUSTOM_ID_LENGTH", "MAX_FAILED_LINE_RATE", "PARTITIONS_START", "NIGHTLY_CRON",
            "BATCH_API_MAX_FILE_BYTES", "BATCH_API_MAX_FILE_REQUESTS", "BATCH_API_MIN_EXPIRY_SECONDS",
            "DAGSTER_WEBSERVER_URL", "AWS_MAX_ATTEMPTS", "AWS_READ_TIMEOUT", "STORAGE_INPUT_PATH"} <= checked


@pytest.mark.parametrize("cell, expected", [
    ("256", (True, "256")), ("0.90", (True, "0.90")), ("`planned`", (True, "planned")),
    ("1 GiB on CPU", (True, 2.0**30)), ("on (`true`)", (True, "on")), ("10485760 (10 MiB)", (True, "10485760")),
    ("none (no limit)", (False, None)), ("vLLM's default", (False, None)),
])
def test_stated_default_reads_the_forms_the_tables_use(cell, expected):
    assert stated_default(cell) == expected


# ---------------------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve_inside_the_repository(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page.resolve()
        if not file.is_relative_to(REPO.resolve()):
            broken.append(f"{target}: outside the repository")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO.resolve())}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("heading, anchor", [
    ("Planned order (ORDER=planned)", "planned-order-orderplanned"),
    ("What a `kill -9` costs", "what-a-kill--9-costs"),
    ("Metrics (`metrics.json`, and the `throughput_metrics` materialization)",
     "metrics-metricsjson-and-the-throughput_metrics-materialization"),
    ("The Batch API's added latency: `bench/api_latency.py`", "the-batch-apis-added-latency-benchapi_latencypy"),
])
def test_slug_follows_githubs_rules(heading, anchor):
    assert slug(heading) == anchor


# ---------------------------------------------------------------------------- the front door


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for page in MARKDOWN:
        used = set(re.findall(r"(?:^|`)make ([a-z][\w-]*)", page.read_text(), re.MULTILINE))
        assert used <= targets, f"{page.relative_to(REPO)} names make targets the Makefile lacks: {used - targets}"
    assert "make demo" in text and "make test" in text  # .ci/run runs `make test`, as the README says


def test_module_map_lists_every_module():
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    listed = [re.sub(r"`", "", row.cells[0]) for row in table_rows(DOCS / "DEVELOPMENT.md", "module")]
    assert len(listed) == len(set(listed))
    assert set(listed) == modules, (
        f"missing from docs/DEVELOPMENT.md: {sorted(modules - set(listed))}; gone: {sorted(set(listed) - modules)}")


def _layers(path: Path) -> list[list[str]]:
    """The layers of the package as a doc's picture draws them, top first: each line's names."""
    text = path.read_text()
    start = text.index("```\ncli/ ")
    picture = text[start + 4:text.index("```", start + 4)]
    return [re.findall(r"([a-z_]+(?:\.py|/))[, ]", line.split("  ")[0] + " ") for line in picture.splitlines()]


def _imports(path: Path) -> list[str]:
    """Every module an import statement of a file names, at any depth of the file."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_imports_point_down_the_layers_the_readme_draws():
    layers = _layers(REPO / "README.md")
    assert layers == _layers(DOCS / "DEVELOPMENT.md"), "README.md and docs/DEVELOPMENT.md draw the same layers"
    rank = {name.rstrip("/").removesuffix(".py"): depth for depth, names in enumerate(layers) for name in names}
    modules = sorted(p for p in PACKAGE.rglob("*.py"))
    placed = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in modules} - {"__init__"}
    assert placed == set(rank), f"the picture and the package's folders: {sorted(placed ^ set(rank))}"
    wrong = []
    for path in modules:
        part = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "batch_pipeline" and len(parts) > 1 and parts[1] in rank:
                if rank[parts[1]] < rank[part]:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name} (a layer above it)")
                elif rank[parts[1]] == rank[part] and parts[1] != part:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name} (sideways: the same layer)")
            if rank[part] > rank["defs"] and parts[0] == "dagster":
                wrong.append(f"{path.relative_to(PACKAGE)} imports Dagster below defs/")
            if rank[part] > rank["engine"] and parts[0] == "vllm":
                wrong.append(f"{path.relative_to(PACKAGE)} imports vLLM below engine/")
    assert not wrong, "\n".join(wrong)


TEST_FOLDERS_BEYOND_LAYERS = {"system"}  # the whole-system tests, which span every layer


def test_the_test_tree_mirrors_the_package():
    """docs/DEVELOPMENT.md's test tree: each test file one folder down, in the folder named for the
    layer it tests (a folder of batch_pipeline/) or in system/;
    nothing but conftest.py at the top; every helper module in support/, imported by name."""
    layers = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")} - {"__init__"}
    folders = layers | TEST_FOLDERS_BEYOND_LAYERS
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        where = path.relative_to(TESTS)
        if path.name.startswith("test_"):
            if len(where.parts) != 2 or where.parts[0] not in folders:
                wrong.append(f"{where}: a test file goes in one of {sorted(folders)}")
            elif not (path.parent / "__init__.py").is_file():
                wrong.append(f"{where}: its folder has no __init__.py")
        elif path.name not in ("__init__.py", "conftest.py") and where.parts[0] != "support":
            wrong.append(f"{where}: a helper module goes in support/")
    assert not wrong, "batch_pipeline_tests/:\n" + "\n".join(wrong)


def test_operations_lists_every_doctor_check():
    from batch_pipeline.cli.doctor import CHECKS

    listed = [row.cells[0].strip("`") for row in table_rows(DOCS / "OPERATIONS.md", "check")]
    assert listed == list(CHECKS), "docs/OPERATIONS.md's doctor table: every check, in CHECKS order"


LONGEST_FUNCTION = 80  # lines, docstring included (docs/DEVELOPMENT.md)


def test_no_function_is_longer_than_a_screen():
    """Every function and method of the package and of the benchmarks (bench/*.py) fits in
    LONGEST_FUNCTION lines: a longer one is split into named parts (as steps/inference.py's _Answering,
    or a benchmark's parse_args, _measure and _report), not allowed to grow."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long

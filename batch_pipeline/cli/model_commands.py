"""`batch-pipeline model ...`: the versions of MODELS_FILE's models, their checksums and aliases.

    batch-pipeline model list
    batch-pipeline model checksum FOLDER          # the sha256 block of a version's MODELS_FILE entry
    batch-pipeline model verify NAME@VERSION [--golden FILE] [--min-match 0.99] [--report PATH]
    batch-pipeline model use NAME@VERSION         # new batches take this version (checksums read first)
    batch-pipeline model rollback NAME            # back to the version before

Switching never touches work already requested (config/model_versions.py, io/model_aliases.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from batch_pipeline.base.errors import ConfigError
from batch_pipeline.config.model_versions import (
    ModelVersions,
    checksums_of,
    split_versioned,
    verify_checksums,
    versioned_name,
)
from batch_pipeline.config.settings import (
    EngineSettings,
    engine_settings_from_env,
    storage_settings_from_env,
)

# io.storage (boto3) is imported by the commands, not here: the CLI builds this parser on every call.

EXIT_OK, EXIT_MISMATCH, EXIT_FAILED = 0, 1, 2
GENERATION_URLS = ("/v1/chat/completions", "/v1/completions")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _settings() -> EngineSettings:
    s = engine_settings_from_env()
    if not s.models_file:
        raise ConfigError("MODELS_FILE is not set: versions are entries of a models file (docs/OPERATIONS.md, "
                          "\"Model versions and rollback\")")
    return s


def _output_root() -> str:
    return storage_settings_from_env().output_path


def _model(s: EngineSettings, name: str) -> ModelVersions:
    versioned = s.versioned_models()
    if name not in versioned:
        raise ConfigError(f"MODELS_FILE={s.models_file}: {name!r} has no versions "
                          f"(versioned models: {', '.join(sorted(versioned)) or 'none'})")
    return versioned[name]


def _target(s: EngineSettings, text: str) -> tuple[ModelVersions, str]:
    name, version = split_versioned(text)
    if not version:
        raise ConfigError(f"{text!r}: name a version, NAME@VERSION")
    model = _model(s, name)
    if version not in model.versions:
        raise ConfigError(f"{name!r} has no version {version!r} (versions: {', '.join(model.versions)})")
    return model, version


def _verify_files(s: EngineSettings, model: ModelVersions, version: str) -> str:
    served = model.served(version)
    folder = Path(s.model_registry()[served].model_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{served}: {folder} is not a model folder (no config.json)")
    sums = model.checksums.get(version)
    if not sums:
        return f"{served}: no checksums in MODELS_FILE (add them: batch-pipeline model checksum {folder})"
    verify_checksums(served, folder, sums, reread=True, log=_log)
    return f"{served}: {len(sums)} weight file(s) match their checksums"


def cmd_list(args: argparse.Namespace) -> int:
    from batch_pipeline.io import model_aliases

    s = _settings()
    aliases = model_aliases.read_aliases(_output_root())
    registry = s.model_registry()
    versioned = s.versioned_models()
    chosen = s.resolved_versions(aliases)  # what new batches use, per model
    rows = []
    for name, model in versioned.items():
        for version in model.versions:
            marks = []
            if version == chosen[name]:
                marks.append("new batches")
            if version == model.current:
                marks.append("MODELS_FILE current")
            if aliases.get(name) == version:
                marks.append("alias")
            rows.append((model.served(version), registry[model.served(version)].model_path,
                         "yes" if model.checksums.get(version) else "no", ", ".join(marks)))
    for name, settings in registry.items():
        if split_versioned(name)[0] not in versioned:
            rows.append((name, settings.model_path, "-", "unversioned"))
    if args.json:
        print(json.dumps([dict(zip(("model", "path", "checksums", "use"), r)) for r in rows], indent=2))
        return EXIT_OK
    widths = [max(len(str(r[i])) for r in [("model", "path", "checksums", "use"), *rows]) for i in range(4)]
    for row in [("model", "path", "checksums", "use"), *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return EXIT_OK


def cmd_checksum(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder")
    sums = checksums_of(folder, log=_log)
    print("sha256:")
    for name, value in sums.items():
        print(f"  {json.dumps(name)}: {value}")
    return EXIT_OK


def cmd_use(args: argparse.Namespace) -> int:
    from batch_pipeline.io import model_aliases

    s = _settings()
    model, version = _target(s, args.target)
    if not args.no_verify:
        print(_verify_files(s, model, version))
    before = s.resolved_versions(model_aliases.read_aliases(_output_root()))[model.name]
    model_aliases.switch(_output_root(), model, version, by=args.by)
    print(f"{model.name}: new batches use {version} (was {before}); batches already created keep theirs")
    return EXIT_OK


def cmd_rollback(args: argparse.Namespace) -> int:
    from batch_pipeline.io import model_aliases

    s = _settings()
    model = _model(s, args.name)
    old, new = model_aliases.rollback(_output_root(), model, by=args.by)
    print(f"{model.name}: rolled back from {old} to {new}; batches already created keep theirs")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from batch_pipeline.io import model_aliases, storage

    s = _settings()
    model, version = _target(s, args.target)
    print(_verify_files(s, model, version))
    if not args.golden:
        return EXIT_OK
    against = args.against or s.resolved_versions(model_aliases.read_aliases(_output_root()))[model.name]
    if against not in model.versions:
        raise ConfigError(f"--against {against!r}: {model.name!r} has no such version")
    if against == version:
        raise ConfigError(f"{model.served(version)} is already the version new batches use; name another with --against")
    report = golden_report(model, version, against, args.golden, args.work_dir)
    print(format_report(report))
    if args.report:
        storage.write_json(args.report, report)
        print(f"report in {args.report}")
    rate = report["greedy"]["exact_match_rate"]
    if report["candidate_failed_lines"]:
        print(f"FAIL: {report['candidate_failed_lines']} line(s) answered by {report['current']} failed on "
              f"{report['candidate']}")
        return EXIT_MISMATCH
    if args.min_match is not None and (rate is None or rate < args.min_match):
        print(f"FAIL: exact-match rate of greedy lines {_pct(rate)} is under --min-match {args.min_match:.2%}")
        return EXIT_MISMATCH
    return EXIT_OK


# --------------------------------------------------------------------------- golden batches


def golden_report(model: ModelVersions, candidate: str, current: str, golden: str, work_dir: str | None = None) -> dict:
    """Answer the golden file's generation lines with both versions in one run (one model after the
    other) and compare them line by line."""
    from batch_pipeline.defs.jobs import run_batch

    lines = _golden_lines(golden)
    work = Path(work_dir or tempfile.mkdtemp(prefix="model-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    both = work / "golden-both.jsonl"
    with both.open("w") as f:
        for tag, version in (("candidate", candidate), ("current", current)):
            for line in lines:
                body = {**line["body"], "model": model.served(version)}
                f.write(json.dumps({**line, "custom_id": f"{tag}:{line['custom_id']}", "body": body}) + "\n")
    output_dir = work / "results"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    _log(f"answering {len(lines)} golden line(s) with {model.served(candidate)} and {model.served(current)} "
         f"(results in {output_dir})")
    result = run_batch(str(both), str(output_dir), _today())
    if not result.success and not (output_dir / "output.jsonl").exists():
        raise ConfigError(f"the golden run failed (run {result.run_id}); see {output_dir}")
    answers = {}
    for name in ("output.jsonl", "errors.jsonl"):
        path = output_dir / name
        if path.exists():
            for raw in path.read_text().splitlines():
                record = json.loads(raw)
                answers[record["custom_id"]] = record
    return compare(lines, answers, model.served(candidate), model.served(current), str(output_dir))


def compare(lines: list[dict], answers: dict[str, dict], candidate: str, current: str, where: str) -> dict[str, Any]:
    greedy = [line for line in lines if _greedy(line["body"])]
    rows, matched, failed = [], 0, 0
    for line in lines:
        a, b = answers.get(f"candidate:{line['custom_id']}"), answers.get(f"current:{line['custom_id']}")
        text_a, text_b = _text(a), _text(b)
        if text_b is not None and text_a is None:
            failed += 1
        same = text_a is not None and text_a == text_b
        if _greedy(line["body"]) and same:
            matched += 1
        if not same:
            rows.append({"custom_id": line["custom_id"], "greedy": _greedy(line["body"]),
                         "candidate": _short(text_a, a), "current": _short(text_b, b)})
    return {
        "candidate": candidate, "current": current, "lines": len(lines), "results": where,
        "greedy": {"lines": len(greedy), "exact_matches": matched,
                   "exact_match_rate": matched / len(greedy) if greedy else None},
        "candidate_failed_lines": failed,
        "differences": rows,
    }


def format_report(report: dict[str, Any]) -> str:
    g = report["greedy"]
    out = [f"golden batch: {report['lines']} generation line(s), {report['candidate']} against {report['current']}",
           f"  greedy lines (temperature 0): {g['lines']}, the same answer on both: {g['exact_matches']} "
           f"({_pct(g['exact_match_rate'])})",
           f"  lines answered by {report['current']} that failed on {report['candidate']}: "
           f"{report['candidate_failed_lines']}"]
    for row in report["differences"][:10]:
        out.append(f"  differs: {row['custom_id']}{' (greedy)' if row['greedy'] else ''}: "
                   f"{row['candidate']!r} vs {row['current']!r}")
    if len(report["differences"]) > 10:
        out.append(f"  ... and {len(report['differences']) - 10} more (the report lists them all)")
    return "\n".join(out)


def _golden_lines(uri: str) -> list[dict]:
    from batch_pipeline.io import storage

    lines = []
    for number, raw in enumerate(storage.read_text(uri).splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise ConfigError(f"--golden {uri}: line {number} is not JSON") from None
        if not isinstance(line, dict) or not isinstance(line.get("body"), dict) or "custom_id" not in line:
            raise ConfigError(f"--golden {uri}: line {number} is not a batch line (custom_id, method, url, body)")
        if line.get("url") in GENERATION_URLS:
            lines.append(line)
    if not lines:
        raise ConfigError(f"--golden {uri}: no chat or completions lines to compare")
    return lines


def _greedy(body: dict) -> bool:
    return body.get("temperature") == 0 or body.get("top_k") == 1


def _text(record: dict | None) -> str | None:
    if not record or not record.get("response") or record["response"].get("status_code") != 200:
        return None
    choices = record["response"]["body"].get("choices") or [{}]
    first = choices[0]
    message = first.get("message") or {}
    return json.dumps([message.get("content"), message.get("tool_calls")]) if message else first.get("text")


def _short(text: str | None, record: dict | None) -> str:
    if text is None:
        error = (record or {}).get("error") or ((record or {}).get("response") or {}).get("body", {}).get("error") or {}
        return f"<no answer: {error.get('code') or error.get('message') or 'missing'}>"
    return text[:80]


def _pct(rate: float | None) -> str:
    return "n/a (no greedy lines)" if rate is None else f"{rate:.1%}"


def _today() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).date().isoformat()


# --------------------------------------------------------------------------- the parser


def add_commands(model_sub: Any) -> None:
    p = model_sub.add_parser("list", help="MODELS_FILE's models and versions, and which version new batches use")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_list)

    p = model_sub.add_parser("checksum", help="print the sha256 block of a model folder's weight files, for its "
                             "MODELS_FILE version entry")
    p.add_argument("folder", help="the version's model folder")
    p.set_defaults(func=cmd_checksum)

    p = model_sub.add_parser("verify", help="read a version's weight files against their checksums; with --golden, "
                             "answer a golden batch with it and with the current version and compare")
    p.add_argument("target", help="NAME@VERSION of MODELS_FILE")
    p.add_argument("--golden", default="", help="a batch file (JSONL) whose chat/completions lines both versions answer")
    p.add_argument("--against", default="", help="the version to compare with (default: the one new batches use)")
    p.add_argument("--min-match", type=float, default=None,
                   help="fail (exit 1) when fewer greedy lines (temperature 0) give the same answer, e.g. 0.99")
    p.add_argument("--report", default="", help="write the report (JSON, every differing line) here")
    p.add_argument("--work-dir", default="", help="folder for the golden run's files (default: a new temporary folder)")
    p.set_defaults(func=cmd_verify)

    p = model_sub.add_parser("use", help="new batches use this version (its checksums are read first); batches "
                             "already created keep theirs")
    p.add_argument("target", help="NAME@VERSION of MODELS_FILE")
    p.add_argument("--no-verify", action="store_true", help="switch without reading the weight files")
    p.add_argument("--by", default="", help="who switched, for the alias history (default: the user name)")
    p.set_defaults(func=cmd_use)

    p = model_sub.add_parser("rollback", help="back to the version new batches used before the last switch")
    p.add_argument("name", help="a versioned model of MODELS_FILE")
    p.add_argument("--by", default="", help="who rolled back, for the alias history (default: the user name)")
    p.set_defaults(func=cmd_rollback)


__all__ = ["add_commands", "compare", "golden_report", "versioned_name"]

"""`batch-pipeline`: validate a batch file, run one through the Dagster assets, serve the Batch API.

    batch-pipeline validate INPUT [--image-column COLUMN]
    batch-pipeline run INPUT --output-dir DIR [--date YYYY-MM-DD] [--image-column COLUMN]
    batch-pipeline serve [--host 127.0.0.1] [--port 8000]
    batch-pipeline usage --since YYYY-MM-DD [--tenant T] [--csv]
    batch-pipeline model prepare
    batch-pipeline model list | checksum FOLDER | verify NAME@VERSION [--golden FILE] | use NAME@VERSION | rollback NAME
    batch-pipeline engine start [--port 8000] [--host 127.0.0.1] [--runner generate|pooling] [--timeout S] | stop [--port 8000] | status
    batch-pipeline doctor

`run` executes the same assets as the Dagster UI, in-process; with DAGSTER_HOME set the run is
recorded in that instance and shows up in the UI.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_INVALID_LINES, EXIT_FAILED = 0, 1, 2
KEEP_ALIVE_SECONDS = 75  # `serve`: how long an idle connection is kept (a load balancer's usual 60 s fits in it)


def _err(message: str) -> None:
    print(f"batch-pipeline: error: {message}", file=sys.stderr)


def cmd_validate(args: argparse.Namespace) -> int:
    from batch_pipeline.defs.resources import LLMResource
    from batch_pipeline.io import storage
    from batch_pipeline.steps.ingest import validate_table
    from batch_pipeline.io.table_inputs import is_table
    from batch_pipeline.steps.validation import validate_stream

    settings = LLMResource().validation_settings()
    if args.served_model_name:
        settings = dataclasses.replace(settings, served_model_name=args.served_model_name)
    image_column = args.image_column.strip()
    if image_column:  # as `run --image-column`: a table's column of images, checked as the run checks them
        if not is_table(args.input):
            _err(f"--image-column is for Parquet/CSV inputs; a JSONL line gives its images in its own body ({args.input})")
            return EXIT_FAILED
        settings = dataclasses.replace(settings, image_column=image_column)
    shown = 0

    def on_invalid(bad: Any) -> None:
        nonlocal shown
        shown += 1
        if args.max_errors <= 0 or shown <= args.max_errors:
            who = f" custom_id={bad.custom_id!r}" if bad.custom_id else ""
            print(f"  line {bad.line} [{bad.code}]{who}: {bad.message.split(': ', 1)[-1]}")

    print(f"validating {args.input} (served model: {settings.served_model_name})")
    try:
        if is_table(args.input):  # a Parquet/CSV batch: each row a chat request
            summary = validate_table(args.input, settings, lambda _r: None, on_invalid)
        else:
            with storage.open_read(args.input) as f:
                summary = validate_stream(f, settings, lambda _r: None, on_invalid)
    except FileNotFoundError as e:
        _err(str(e))
        return EXIT_FAILED
    if 0 < args.max_errors < shown:
        print(f"  ... and {shown - args.max_errors} more invalid lines")
    by_code = ", ".join(f"{k}={v}" for k, v in sorted(summary.errors_by_code.items())) or "none"
    print(f"{summary.lines} requests: {summary.valid} valid, {summary.invalid} invalid ({by_code})")
    file_error = summary.file_error()
    if file_error:
        print(f"the batch would fail: {file_error.message}")
    return EXIT_INVALID_LINES if summary.invalid or file_error else EXIT_OK


def _wrote_results(result: Any) -> bool:
    """Whether this run's batch_outputs step wrote a batch's result files (a shard run does only when
    it finds every shard of the batch done)."""
    for event in result.get_asset_materialization_events():
        if event.asset_key.to_user_string() == "batch_outputs":
            batches = event.materialization.metadata.get("batches")
            return bool(batches and batches.value)
    return False


def _shards_waiting(input_uri: str, output_dir: str, partition: str, shard: Any) -> list[int]:
    """The shards of this batch that have not finished (numbered from 1)."""
    from batch_pipeline.io import locations
    from batch_pipeline.io.shards import shard_records, unfinished_shards

    loc = locations.BatchLocation(locations.batch_name(input_uri), input_uri, output_dir, partition)
    return unfinished_shards(shard_records(loc, shard.count))


def _failure_reason(result: Any) -> str:
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data and event.step_failure_data.error:
            error = event.step_failure_data.error
            while error.cause is not None and "Failure" not in error.cls_name:
                error = error.cause
            return error.message.strip().splitlines()[-1] if error.message.strip() else error.cls_name
    return "the run failed"


def cmd_run(args: argparse.Namespace) -> int:
    from batch_pipeline.io import storage

    # vLLM's INFO and WARNING lines (config dumps, CPU tuning hints) drown the progress lines.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    input_uri = args.input if args.input.startswith("s3://") else os.path.abspath(args.input)
    output_dir = args.output_dir if args.output_dir.startswith("s3://") else os.path.abspath(args.output_dir)
    if not storage.exists(input_uri):
        _err(f"input not found: {input_uri}")
        return EXIT_FAILED
    from batch_pipeline.defs.resources import LLMResource
    from batch_pipeline.engine.engine_args import require_hardware

    from batch_pipeline.io.shards import Shard

    shard = Shard.parse(args.shard, "--shard")
    image_column = args.image_column.strip()
    if image_column and input_uri.lower().endswith((".jsonl", ".json", ".ndjson")):
        _err(f"--image-column is for Parquet/CSV inputs; a JSONL line gives its images in its own body ({input_uri})")
        return EXIT_FAILED
    settings = LLMResource().settings()
    if not settings.engine_url:  # before any work: e.g. a GPU preset on a CPU machine. A warm engine's run
        require_hardware(settings)  # needs no GPU of its own, nor torch imported to count them (2.5 s here)
    from batch_pipeline.defs.jobs import run_batch

    result = run_batch(input_uri, output_dir, args.date, shard=args.shard, image_column=image_column)
    if not shard.whole and result.success and not _wrote_results(result):
        # Another shard writes the results: still answering, or finishing right now.
        waiting = _shards_waiting(input_uri, output_dir, args.date, shard)
        still = f"waiting for shard(s) {', '.join(map(str, waiting))}" if waiting else "another shard is writing them"
        print(f"shard {shard} of {input_uri} done; results go into {output_dir} once every shard is done ({still})")
        return EXIT_OK
    batch_uri = storage.join(output_dir, "batch.json")
    batch = json.loads(storage.read_text(batch_uri)) if storage.exists(batch_uri) else None
    if batch is None or (not result.success and batch.get("status") == "completed"):
        _err(_failure_reason(result))
        return EXIT_FAILED
    counts = batch["request_counts"]
    earlier = batch.get("metadata", {}).get("dagster_run_id")
    if result.success and earlier and earlier != result.run_id and batch["status"] == "completed":
        print(f"already completed from this file with this model by run {earlier}; results left as they were")
    print(
        f"batch {batch['id']} {batch['status']}: {counts['total']} requests, "
        f"{counts['completed']} completed, {counts['failed']} failed"
    )
    if storage.exists(storage.join(output_dir, "metrics.json")):
        m = json.loads(storage.read_text(storage.join(output_dir, "metrics.json")))
        print(
            f"inference {m['inference_seconds']:.1f}s ({m['requests_per_second']:.2f} req/s, "
            f"{m['output_tokens_per_second']:.1f} output tok/s), model load {m['model_load_seconds']:.1f}s"
        )
    print(f"results in {output_dir}: output.jsonl errors.jsonl results.parquet batch.json metrics.json")
    if batch["status"] != "completed":
        errors = (batch.get("errors") or {}).get("data") or [{"message": batch["status"]}]
        _err(f"batch {batch['status']}: {errors[0]['message']}")
        return EXIT_FAILED
    return EXIT_OK


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from batch_pipeline.config import models

    path = models.prepare_bundled_model(log=lambda m: print(m, file=sys.stderr))
    models.embedding_model_dir()
    print(path)
    return EXIT_OK


def _engine_model(runner: str) -> tuple[str, str]:
    """(folder, served name) a warm engine serves: the one a run would use (MODEL_PATH or the bundled
    model, built if missing; EMBEDDING_MODEL_PATH or the bundled one for the pooling runner)."""
    from batch_pipeline.config import models
    from batch_pipeline.config.settings import ConfigError
    from batch_pipeline.defs.resources import LLMResource

    resource = LLMResource()
    if runner == "pooling":
        path, served = resource.embedding_model()
        if path is None or served is None:
            raise ConfigError("EMBEDDING_MODEL_PATH is not set and the bundled embedding model is not installed "
                              f"({models.EMBEDDING_INSTALL})")
        return path, served
    path, served = resource.generation_model()
    return path or str(models.prepare_bundled_model(log=lambda m: print(m, flush=True))), served


def cmd_engine_start(args: argparse.Namespace) -> int:
    from batch_pipeline.defs.resources import LLMResource
    from batch_pipeline.engine import server
    from batch_pipeline.engine.engine_args import require_hardware

    settings = LLMResource().settings()
    require_hardware(settings)  # e.g. a GPU preset on a CPU machine: refused before anything starts
    path, served = _engine_model(args.runner)
    try:
        server.start(settings, args.port, path, served, host=args.host, runner=args.runner,
                     log=lambda m: print(m, flush=True), timeout=args.timeout)
    except server.EngineServerError as e:
        _err(str(e))
        return EXIT_FAILED
    return EXIT_OK


def cmd_engine_stop(args: argparse.Namespace) -> int:
    from batch_pipeline.engine import server

    try:
        server.stop(args.port, log=lambda m: print(m, flush=True))
    except server.EngineServerError as e:
        _err(str(e))
        return EXIT_INVALID_LINES
    return EXIT_OK


def cmd_engine_status(args: argparse.Namespace) -> int:
    from batch_pipeline.engine import server

    engines = server.status()
    if not engines:
        print(f"no engine recorded (under {server.engines_dir()})")
    for engine in engines:
        print(engine.line())
    return EXIT_OK if all(e.up for e in engines) else EXIT_INVALID_LINES


def cmd_doctor(args: argparse.Namespace) -> int:
    from batch_pipeline.cli import doctor

    results = doctor.run_checks(only=args.only or None)
    print(doctor.format_report(results))
    return EXIT_OK if doctor.all_ok(results) else EXIT_INVALID_LINES


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from batch_pipeline.service.app import create_app, service_from_env

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = service_from_env()  # a bad BATCH_API_KEYS fails here, naming the variable
    _start_sweeper(service)
    print(f"Batch API on http{'s' if args.ssl_certfile else ''}://{args.host}:{args.port}/v1 "
          f"({len(set(service.keys.values()))} tenant(s)); runs go to the Dagster web server at {service.dagster_url}",
          flush=True)
    uvicorn.run(create_app(service), host=args.host, port=args.port, ssl_certfile=args.ssl_certfile,
                ssl_keyfile=args.ssl_keyfile, log_level="info", access_log=False,
                # An idle kept-alive connection is closed by the client first: the openai SDK (httpx)
                # drops its own after 5 s, uvicorn's default is 5 s too, and at the same 5 s a
                # client could send on a connection the server was closing ("connection reset").
                timeout_keep_alive=KEEP_ALIVE_SECONDS,
                # On SIGTERM, open (keep-alive) connections get this long; then the process exits.
                timeout_graceful_shutdown=10)
    return EXIT_OK


def _start_sweeper(service: Any) -> None:
    """A cancel that came while Dagster was starting the run is carried out once the run has started,
    whether or not a client reads the batch again (Service.sweep_pending_terminations)."""
    import logging
    import threading
    import time

    from batch_pipeline.service.operations import SWEEP_SECONDS

    def sweep() -> None:
        while True:
            time.sleep(SWEEP_SECONDS)
            try:
                service.sweep_pending_terminations()
            except Exception as e:  # noqa: BLE001 - Dagster or storage away for a moment: the next sweep retries
                logging.getLogger("batch_pipeline.service").warning("pending cancels not swept: %s: %s",
                                                                    type(e).__name__, str(e)[:200])

    threading.Thread(target=sweep, name="cancel-sweeper", daemon=True).start()


def cmd_usage(args: argparse.Namespace) -> int:
    from batch_pipeline.config.settings import storage_settings_from_env
    from batch_pipeline.service.store import Store
    from batch_pipeline.service.usage import as_csv, as_table, usage_rows

    try:
        since = dt.date.fromisoformat(args.since)
    except ValueError:
        _err(f"--since {args.since!r} is not a date (YYYY-MM-DD)")
        return EXIT_FAILED
    rows = usage_rows(Store(storage_settings_from_env().output_path), since, args.tenant or None)
    print(as_csv(rows) if args.csv else as_table(rows), end="")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batch-pipeline", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check a batch file against the contract; no model needed")
    p.add_argument("input", help="batch file: a local path or s3://bucket/key")
    p.add_argument("--served-model-name", default="", help="model name body.model must say (default: SERVED_MODEL_NAME)")
    p.add_argument("--max-errors", type=int, default=100, help="invalid lines to print (0 = all)")
    p.add_argument("--image-column", default="", metavar="COLUMN",
                   help="Parquet/CSV input: the column holding each row's image, as `run --image-column` takes it "
                   "(default: TABLE_IMAGE_COLUMN where the table has it)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="run a batch file through the pipeline")
    p.add_argument("input", help="batch file: a local path or s3://bucket/key")
    p.add_argument("--output-dir", required=True, help="folder or s3:// prefix for the five result files "
                   "(output.jsonl, errors.jsonl, results.parquet, batch.json, metrics.json)")
    p.add_argument(
        "--date",
        default=dt.datetime.now(dt.timezone.utc).date().isoformat(),
        help="partition date the run is recorded under (default: today, UTC)",
    )
    p.add_argument(
        "--shard",
        default="",
        help="i/n: answer only the i-th of n line ranges (e.g. 2/4), one command per server; the last shard "
        "to finish writes the results into --output-dir (shared storage, e.g. s3://)",
    )
    p.add_argument(
        "--image-column",
        default="",
        metavar="COLUMN",
        help="Parquet/CSV input: the column holding each row's image (bytes, an s3:// or https:// URI, a data: URL "
        "or a path relative to the table's folder; or a list of them) for a vision-language model "
        "(the run config's batch.image_column)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("doctor", help="check engine, model, storage, Dagster instance and GPUs; exit 1 on a failure")
    p.add_argument("--only", action="append", default=[], help="run only this check (repeatable)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("serve", help="OpenAI's Files and Batches API over Dagster runs (the openai SDK unchanged)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM); or run behind a TLS proxy")
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("usage", help="what the Batch API's finished batches cost, per tenant and model "
                       "(GPU- and engine-seconds, model load, tokens), from the service's records")
    p.add_argument("--since", required=True, help="batches created on or after this date (YYYY-MM-DD, UTC)")
    p.add_argument("--tenant", default="", help="only this tenant's batches")
    p.add_argument("--csv", action="store_true", help="CSV (a header, then a row per tenant and model) instead of a table")
    p.set_defaults(func=cmd_usage)

    p = sub.add_parser("model", help="the bundled model, and MODELS_FILE's model versions: checksums, verify, "
                       "switch and roll back")
    model_sub = p.add_subparsers(dest="model_command", required=True)
    prep = model_sub.add_parser("prepare", help="build the bundled SmolLM2 checkpoint if missing; prints its folder")
    prep.set_defaults(func=cmd_model_prepare)
    from batch_pipeline.cli import model_commands

    model_commands.add_commands(model_sub)  # list, checksum, verify, use, rollback
    _add_engine_commands(sub)
    return parser


def _add_engine_commands(sub: Any) -> None:
    from batch_pipeline.engine.server import DEFAULT_PORT, DEFAULT_START_TIMEOUT

    p = sub.add_parser("engine", help="a warm engine: vLLM's OpenAI-compatible server with the engine settings "
                       "a run uses, started, stopped and listed")
    engine_sub = p.add_subparsers(dest="engine_command", required=True)
    start = engine_sub.add_parser("start", help="start the server (MODEL_PATH or the bundled model) and wait until "
                                  "it answers /health; prints its URL and models")
    start.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    start.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    start.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                       help="generate (chat, completions; the default) or pooling (embeddings, score, rerank "
                       "on EMBEDDING_MODEL_PATH)")
    start.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT,
                       help=f"seconds to wait for /health before stopping it and failing (default {DEFAULT_START_TIMEOUT:.0f})")
    start.set_defaults(func=cmd_engine_start)
    stop = engine_sub.add_parser("stop", help="stop the engine recorded on a port (SIGTERM, then SIGKILL)")
    stop.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    stop.set_defaults(func=cmd_engine_stop)
    status = engine_sub.add_parser("status", help="every recorded engine: URL, process, /health, models; "
                                   "exit 1 if one is down")
    status.set_defaults(func=cmd_engine_status)


def main(argv: Sequence[str] | None = None) -> int:
    from batch_pipeline.base.runtime import exit_without_teardown

    code = _main(argv)
    if argv is None:  # the `batch-pipeline` command itself, not a caller in the same process
        exit_without_teardown(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - a one-line reason instead of a traceback for users
        from batch_pipeline.config.settings import ConfigError

        if isinstance(e, (ConfigError, FileNotFoundError, PermissionError)):
            _err(str(e))
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())

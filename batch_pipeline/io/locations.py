"""Where batches come from and where their results go, and which batches one run takes.

A batch file `<input>/<YYYY-MM-DD>/<name>.jsonl` belongs to that date; `<input>/<name>.jsonl` to the
UTC date it was uploaded. Its results go to `<output>/<date>/<name>/`:

    output.jsonl  errors.jsonl  batch.json  metrics.json      the results (the contract)
    results.parquet        the same lines as a table (io/tables.py)
    _work/passthrough.parquet  a table input's carried-through columns
    _work/requests.jsonl   valid requests, in input order
    _work/invalid.jsonl    lines that failed validation
    _work/validation.json  counts, checksum, batch id, timings
    _work/answers/<checkpoint key>/part-*.jsonl   finished answers, each part written atomically
    _work/inference.json   engine identity and timings

The first step of a run records the batches it takes (`RunBatches`), and every later step of that
run (and its retries and re-executions) works on exactly those: a file that lands in the date's
folder mid-run is left for the next run or the upload sensor.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from batch_pipeline.io import storage

INPUT_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".csv")  # tables: io/table_inputs.py


@dataclass(frozen=True)
class BatchLocation:
    """Where one batch file comes from and where its results go."""

    name: str
    input_uri: str
    output_uri: str
    partition: str

    def out(self, *parts: str) -> str:
        return storage.join(self.output_uri, *parts)

    def work(self, *parts: str) -> str:
        return storage.join(self.output_uri, "_work", *parts)


def batch_name(input_uri: str) -> str:
    name = storage.basename(input_uri)
    for suffix in INPUT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def is_batch_file(uri: str) -> bool:
    return uri.endswith(INPUT_SUFFIXES)


def upload_date(info: storage.ObjectInfo) -> str:
    """The UTC date an object was uploaded (last modified): the partition of an undated batch file."""
    return dt.datetime.fromtimestamp(info.modified, tz=dt.timezone.utc).date().isoformat()


def partition_inputs(input_root: str, partition: str) -> list[storage.ObjectInfo]:
    """Batch files of one date: everything under `<root>/<date>/`, plus files directly under the
    root that were uploaded on that date (UTC)."""
    dated = storage.list_objects(storage.join(input_root, partition), recursive=False)
    undated = [o for o in storage.list_objects(input_root, recursive=False) if upload_date(o) == partition]
    return [o for o in dated + undated if is_batch_file(o.uri)]


def default_output(output_root: str, partition: str, name: str) -> str:
    return storage.join(output_root, partition, name)


def resolve_batches(input_uri: str, output_uri: str, input_root: str, output_root: str, partition: str) -> list[BatchLocation]:
    """The batches a run config names.

    With an explicit input file: that file, into `output_uri` (default
    `<output_root>/<partition>/<batch name>/`). With an explicit folder/prefix: every batch file
    directly in it. With neither: the partition's files (`partition_inputs`). Each folder batch goes
    to `<output_uri or output_root/partition>/<batch name>/`.
    """
    if input_uri and is_batch_file(input_uri) and storage.exists(input_uri):
        name = batch_name(input_uri)
        target = output_uri or default_output(output_root, partition, name)
        return [BatchLocation(name=name, input_uri=input_uri, output_uri=target, partition=partition)]
    if input_uri:
        found = [o for o in storage.list_objects(input_uri, recursive=False) if is_batch_file(o.uri)]
        if not found and not storage.list_objects(input_uri):
            raise FileNotFoundError(f"no batch file or folder at {input_uri}")
    else:
        found = partition_inputs(input_root, partition)
    base = output_uri or storage.join(output_root, partition)
    locations = [
        BatchLocation(name=batch_name(o.uri), input_uri=o.uri, output_uri=storage.join(base, batch_name(o.uri)), partition=partition)
        for o in found
    ]
    return _one_writer_each(locations)


def find_batch_file(input_root: str, output_root: str, partition: str, name: str) -> BatchLocation | None:
    """Batch `name` of one date (`<input>/<date>/<name>.jsonl`, or `<input>/<name>.jsonl` uploaded
    that day, any batch suffix), or None when no such file is there now."""
    found = [o for o in partition_inputs(input_root, partition) if batch_name(o.uri) == name]
    if not found:
        return None
    [loc] = _one_writer_each([
        BatchLocation(name=name, input_uri=o.uri, output_uri=default_output(output_root, partition, name), partition=partition)
        for o in found
    ])
    return loc


def _one_writer_each(found: list[BatchLocation]) -> list[BatchLocation]:
    """`found`, unless two batches would write into one folder: a.jsonl and a.json (or a dated and
    an undated a.jsonl) would overwrite each other's results."""
    claimed: dict[str, str] = {}
    for loc in found:
        if loc.output_uri in claimed:
            raise ValueError(f"{claimed[loc.output_uri]} and {loc.input_uri} would both write to {loc.output_uri}: rename one")
        claimed[loc.output_uri] = loc.input_uri
    return found


def resolve_files(input_uris: list[str], output_root: str, partition: str,
                  log: Callable[[str], None] = lambda _m: None) -> list[BatchLocation]:
    """Several named batch files of one date, each into `<output_root>/<partition>/<batch name>/`.
    A file gone since it was named (deleted or replaced by a rename) is left out with a log line;
    two files that would write into one folder are refused."""
    found = []
    for uri in dict.fromkeys(input_uris):
        if not is_batch_file(uri):
            raise ValueError(f"{uri} is not a batch file (.jsonl, .json, .ndjson, .parquet, .csv)")
        if not storage.exists(uri):
            log(f"{uri} is gone since this run was requested; left out")
            continue
        name = batch_name(uri)
        found.append(BatchLocation(name=name, input_uri=uri, output_uri=default_output(output_root, partition, name), partition=partition))
    return _one_writer_each(found)


def completed_batch(loc: BatchLocation, input_etag: str | None = None) -> dict[str, Any] | None:
    """The batch.json of a batch completed from the very file now at its input (same ETag), or None.
    `input_etag` saves a HEAD request when the caller has just listed the file.

    This is the check the nightly schedule, backfills and the upload sensor share: a file version
    that has been answered in full is not run again.
    """
    batch_uri = loc.out("batch.json")
    if not storage.exists(batch_uri):
        return None
    batch = storage.read_json(batch_uri)
    etag = (batch.get("metadata") or {}).get("input_etag")
    if batch.get("status") != "completed" or not etag:
        return None
    if input_etag is None:
        if not storage.exists(loc.input_uri):
            return None
        input_etag = storage.describe(loc.input_uri).etag
    return batch if etag == input_etag else None


# ------------------------------------------------------------------------------ one run's batches


def runs_folder(input_uri: str, output_uri: str, output_root: str, partition: str, several: bool = False) -> str:
    """Where a run records its batch list: a hidden `.runs/` beside a date's (or folder's) batch
    folders (listings and the upload sensor skip dot-names), or the one batch's `_work/runs/`.
    `several`: the run names several files of the date (input_uris): the date's `.runs/`."""
    if several:
        return storage.join(output_root, partition, ".runs")
    if input_uri and is_batch_file(input_uri):
        single = output_uri or default_output(output_root, partition, batch_name(input_uri))
        return storage.join(single, "_work", "runs")
    return storage.join(output_uri or storage.join(output_root, partition), ".runs")


@dataclass(frozen=True)
class RunBatches:
    """The batches one run (with its retries and re-executions) works on, fixed by its first step."""

    run_id: str
    batches: tuple[BatchLocation, ...]
    skipped: tuple[str, ...] = ()  # names of batches already completed from the same file

    def write(self, folder: str) -> None:
        storage.write_json(storage.join(folder, f"{self.run_id}.json"), {
            "run_id": self.run_id,
            "batches": [asdict(loc) for loc in self.batches],
            "skipped": list(self.skipped),
        })

    @classmethod
    def read(cls, folder: str, run_id: str) -> "RunBatches | None":
        uri = storage.join(folder, f"{run_id}.json")
        if not storage.exists(uri):
            return None
        data = storage.read_json(uri)
        return cls(run_id, tuple(BatchLocation(**loc) for loc in data["batches"]), tuple(data.get("skipped", ())))

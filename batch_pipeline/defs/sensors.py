"""`batch_upload_sensor`: one `batch_job` run for every new or changed batch file under STORAGE_INPUT_PATH.

Which partition a file belongs to follows `lib.batches.partition_inputs`, the rule the assets use:
`<input>/<YYYY-MM-DD>/<name>.jsonl` belongs to that date, `<input>/<name>.jsonl` to the UTC date it
was uploaded. Anything else (a folder that is not a date, a date outside the partitions, a deeper
path, a second file with the same batch name and date, which would write into the same output
folder) is ignored with one log line per file version.

The cursor keeps the newest modification time seen (`mark`) and short fingerprints of the files
modified in the LOOKBACK_SECONDS before it; older files count as handled. Dagster stores the cursor
in every tick row (skipped ticks are kept 7 days: ~20,000 rows at a 30 s interval), so its size
must follow the upload rate, not the number of files ever seen: ~15 bytes per file uploaded in the
window, e.g. 15 kB for 1,000 uploads a day, where a map of every uri -> etag would grow forever.
The run key `<uri>@<etag>` is the second guard: Dagster never launches the same key twice for this
sensor, so a lost or reset cursor re-requests old files but starts no run for them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import dagster as dg

from batch_pipeline.defs.jobs import batch_job, batch_run_config
from batch_pipeline.defs.partitions import daily_partitions
from batch_pipeline.defs.resources import StorageResource
from batch_pipeline.lib import batches as b
from batch_pipeline.lib.storage import ObjectInfo, is_s3, join, list_objects

# The daemon checks sensors about every 5 s; 30 s keeps a large S3 listing (one LIST call per
# 1,000 keys) cheap while a new file still starts within half a minute. A constant, not an
# environment variable: decorator arguments are fixed when the definitions load.
SENSOR_INTERVAL_SECONDS = 30
# Files modified more than this before the newest file seen are taken as handled. It has to cover
# the longest upload: S3 dates a multipart upload by its start, and `cp -p`/`rsync -t` keep old
# local mtimes.
LOOKBACK_SECONDS = 24 * 3600
# Local files modified this recently may still be being written (a plain `cp`): wait a tick.
# S3 objects appear only once complete, so they need no wait.
LOCAL_SETTLE_SECONDS = 5.0
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
CURSOR_VERSION = 1


def fingerprint(relative: str, etag: str) -> str:
    """12 hex digits naming one version of one file (48 bits: no collision in any real window)."""
    return hashlib.sha256(f"{relative}\0{etag}".encode()).hexdigest()[:12]


@dataclass
class UploadCursor:
    mark: float | None = None  # newest modification time seen (epoch seconds); None: nothing yet
    seen: set[str] = field(default_factory=set)  # fingerprints of files modified since mark - LOOKBACK

    @classmethod
    def parse(cls, raw: str | None) -> "UploadCursor":
        if not raw:
            return cls()
        data = json.loads(raw)
        if data.get("v") != CURSOR_VERSION:
            raise ValueError(f"unknown batch_upload_sensor cursor version: {raw[:80]!r}")
        return cls(mark=data["mark"], seen=set(data["seen"]))

    def dumps(self) -> str:
        return json.dumps({"v": CURSOR_VERSION, "mark": self.mark, "seen": sorted(self.seen)}, separators=(",", ":"))


@dataclass(frozen=True)
class NewBatch:
    info: ObjectInfo
    partition: str

    @property
    def run_key(self) -> str:
        return f"{self.info.uri}@{self.info.etag}"


def folder_prefix(root: str) -> str:
    """`root` with exactly one trailing separator, spelled as list_objects spells its URIs."""
    return join(root, "x")[:-1]


def partition_of(relative: str, info: ObjectInfo) -> tuple[str | None, str]:
    """(partition, "") for a file the batch job can take, (None, reason) otherwise."""
    parts = relative.split("/")
    if len(parts) == 1:
        day = b.upload_date(info)
    elif len(parts) == 2:
        day = parts[0]
        try:
            if not _DATE.fullmatch(day):
                raise ValueError("not YYYY-MM-DD")
            dt.date.fromisoformat(day)
        except ValueError as e:
            return None, f"folder {day!r} is not a date ({e})"
    else:
        return None, "nested deeper than <input>/<date>/<file>"
    if not daily_partitions.has_partition_key(day):
        first = daily_partitions.get_first_partition_key()
        if first and day < first:
            return None, f"date {day} is before the first partition, {first}"
        return None, f"date {day} is not a partition yet (nightly_batch_schedule runs the day once it is over)"
    return day, ""


def find_new_batches(
    root: str,
    objects: Iterable[ObjectInfo],
    cursor: UploadCursor,
    now: float,
    log: Callable[[str], None],
    exclude: str = "",
) -> tuple[list[NewBatch], UploadCursor]:
    """The batch files not handled yet, and the cursor that marks them handled."""
    prefix = folder_prefix(root)
    local = not is_s3(root)
    candidates = [
        o
        for o in objects
        if o.uri.startswith(prefix)
        and o.uri.endswith(b.INPUT_SUFFIXES)
        and not (exclude and o.uri.startswith(exclude))
        and not (local and o.modified > now - LOCAL_SETTLE_SECONDS)
    ]
    placed = {o.uri: partition_of(o.uri[len(prefix) :], o) for o in candidates}
    # Files of one date with one batch name share the output folder <output>/<date>/<name>/.
    writers: dict[tuple[str, str], list[str]] = {}
    for uri, (partition, _) in placed.items():
        if partition is not None:
            writers.setdefault((partition, b.batch_name(uri)), []).append(uri)
    floor = cursor.mark - LOOKBACK_SECONDS if cursor.mark is not None else -math.inf
    found: list[NewBatch] = []
    for info in sorted(candidates, key=lambda o: (o.modified, o.uri)):
        if info.modified < floor or fingerprint(info.uri[len(prefix) :], info.etag) in cursor.seen:
            continue
        partition, reason = placed[info.uri]
        if partition is None:
            log(f"ignoring {info.uri}: {reason}")
            continue
        name = b.batch_name(info.uri)
        others = [uri for uri in writers[(partition, name)] if uri != info.uri]
        if others:
            log(
                f"ignoring {info.uri}: {others[0]} is also batch {name!r} of {partition} and the two would "
                "overwrite each other's results; rename one and upload it again"
            )
            continue
        found.append(NewBatch(info, partition))
    mark = max([o.modified for o in candidates] + ([cursor.mark] if cursor.mark is not None else []), default=None)
    keep_from = mark - LOOKBACK_SECONDS if mark is not None else -math.inf
    seen = {fingerprint(o.uri[len(prefix) :], o.etag) for o in candidates if o.modified >= keep_from}
    return found, UploadCursor(mark=mark, seen=seen)


def run_request(new: NewBatch) -> dg.RunRequest:
    uri = new.info.uri
    return dg.RunRequest(
        run_key=new.run_key,
        partition_key=new.partition,
        run_config=batch_run_config(input_uri=uri),
        tags={"batch_pipeline/input_uri": uri, "batch_pipeline/batch_name": b.batch_name(uri)},
    )


# Stopped until someone turns it on (UI: Automation, or `dagster sensor start batch_upload_sensor`):
# on a fresh instance it would otherwise start runs, and load the model, for every file already in
# the input folder the moment `make dev` comes up.
@dg.sensor(
    job=batch_job,
    minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description=(
        "Starts batch_job for every new or changed .jsonl/.json/.ndjson file under STORAGE_INPUT_PATH "
        "(<date>/<name>.jsonl runs as that date; <name>.jsonl as its upload date, UTC)."
    ),
)
def batch_upload_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
    settings = storage.settings()
    root = settings.input_path
    output = folder_prefix(settings.output_path)
    # Results written under the input folder must never trigger runs of their own.
    exclude = output if output.startswith(folder_prefix(root)) else ""
    cursor = UploadCursor.parse(context.cursor)
    objects = list_objects(root)
    found, new_cursor = find_new_batches(root, objects, cursor, time.time(), context.log.info, exclude=exclude)
    for new in found:
        context.log.info(f"new batch file {new.info.uri} (etag {new.info.etag}) -> partition {new.partition}")
    return dg.SensorResult(
        run_requests=[run_request(new) for new in found],
        skip_reason=None if found else f"no new batch files under {root} ({len(objects)} objects listed)",
        cursor=new_cursor.dumps(),
    )

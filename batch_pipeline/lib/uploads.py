"""Which uploaded batch files are new: the logic of `batch_upload_sensor`, without Dagster.

Which partition a file belongs to follows `locations.partition_inputs`, the rule the batch steps
use: `<input>/<YYYY-MM-DD>/<name>.jsonl` belongs to that date, `<input>/<name>.jsonl` to the UTC date
it was uploaded. Anything else (a folder that is not a date, a date outside the partitions, a deeper
path, a second file with the same batch name and date, which would write into the same output
folder) is ignored with one log line per file version.

The cursor keeps the newest modification time seen (`mark`) and short version ids of the files
modified in the LOOKBACK_SECONDS before it; older files count as handled. Dagster stores the cursor
in every tick row (skipped ticks are kept 7 days: ~20,000 rows at a 30 s interval), so its size
must follow the upload rate, not the number of files ever seen: ~15 bytes per file uploaded in the
window, e.g. 15 kB for 1,000 uploads a day, where a map of every uri -> etag would grow forever.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batch_pipeline.lib import locations, storage
from batch_pipeline.lib.storage import ObjectInfo

# Files modified more than this before the newest file seen are taken as handled. It has to cover
# the longest upload: S3 dates a multipart upload by its start, and `cp -p`/`rsync -t` keep old
# local mtimes.
LOOKBACK_SECONDS = 24 * 3600
# Local files modified this recently may still be being written (a plain `cp`): wait a tick.
# S3 objects appear only once complete, so they need no wait.
LOCAL_SETTLE_SECONDS = 5.0
CURSOR_VERSION = 1
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def version_id(relative: str, etag: str) -> str:
    """12 hex digits naming one version of one file (48 bits: no collision in any real window)."""
    return hashlib.sha256(f"{relative}\0{etag}".encode()).hexdigest()[:12]


@dataclass
class UploadCursor:
    mark: float | None = None  # newest modification time seen (epoch seconds); None: nothing yet
    seen: set[str] = field(default_factory=set)  # version ids of files modified since mark - LOOKBACK

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


@dataclass(frozen=True)
class PartitionRange:
    """The dates that are partitions (inclusive, YYYY-MM-DD)."""

    first: str
    last: str


def folder_prefix(root: str) -> str:
    """`root` with exactly one trailing separator, spelled as list_objects spells its URIs."""
    return storage.join(root, "x")[:-1]


def partition_of(relative: str, info: ObjectInfo, partitions: PartitionRange) -> tuple[str | None, str]:
    """(partition, "") for a file the batch job can take, (None, reason) otherwise."""
    parts = relative.split("/")
    if len(parts) == 1:
        day = locations.upload_date(info)
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
    if day < partitions.first:
        return None, f"date {day} is before the first partition, {partitions.first}"
    if day > partitions.last:
        return None, f"date {day} is not a partition yet (nightly_batch_schedule runs the day once it is over)"
    return day, ""


def find_new_batches(
    root: str,
    objects: Iterable[ObjectInfo],
    cursor: UploadCursor,
    now: float,
    partitions: PartitionRange,
    log: Callable[[str], None],
    exclude: str = "",
) -> tuple[list[NewBatch], UploadCursor]:
    """The batch files not handled yet, and the cursor that marks them handled."""
    prefix = folder_prefix(root)
    local = not storage.is_s3(root)
    candidates = [
        o
        for o in objects
        if o.uri.startswith(prefix)
        and locations.is_batch_file(o.uri)
        and not (exclude and o.uri.startswith(exclude))
        and not (local and o.modified > now - LOCAL_SETTLE_SECONDS)
    ]
    placed = {o.uri: partition_of(o.uri[len(prefix) :], o, partitions) for o in candidates}
    # Files of one date with one batch name share the output folder <output>/<date>/<name>/.
    writers: dict[tuple[str, str], list[str]] = {}
    for uri, (partition, _) in placed.items():
        if partition is not None:
            writers.setdefault((partition, locations.batch_name(uri)), []).append(uri)
    floor = cursor.mark - LOOKBACK_SECONDS if cursor.mark is not None else -math.inf
    found: list[NewBatch] = []
    for info in sorted(candidates, key=lambda o: (o.modified, o.uri)):
        if info.modified < floor or version_id(info.uri[len(prefix) :], info.etag) in cursor.seen:
            continue
        partition, reason = placed[info.uri]
        if partition is None:
            log(f"ignoring {info.uri}: {reason}")
            continue
        name = locations.batch_name(info.uri)
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
    seen = {version_id(o.uri[len(prefix) :], o.etag) for o in candidates if o.modified >= keep_from}
    return found, UploadCursor(mark=mark, seen=seen)


def already_completed(new: NewBatch, output_root: str) -> bool:
    """True when this very file version was answered in full already (by a backfill, the nightly
    schedule or an earlier run): the check the date runs use, so no run is started for it."""
    name = locations.batch_name(new.info.uri)
    loc = locations.BatchLocation(name, new.info.uri, locations.default_output(output_root, new.partition, name), new.partition)
    return locations.completed_batch(loc, input_etag=new.info.etag) is not None

"""Which uploaded batch files are new: the logic of `batch_upload_sensor`, without Dagster.

Which partition a file belongs to follows `locations.partition_inputs`, the rule the batch steps
use: `<input>/<YYYY-MM-DD>/<name>.jsonl` belongs to that date, `<input>/<name>.jsonl` to the UTC date
it was uploaded. Anything else (a folder that is not a date, a date outside the partitions, a deeper
path, a second file with the same batch name and date, which would write into the same output
folder) is ignored with one log line per file version.

**What a tick reads** (`list_inputs`): the top of the input folder and the date folders of the
window (SENSOR_WINDOW_DAYS, default the last 3 dates up to today), one listing each: a tick costs
what can still receive uploads, not every file ever uploaded. A file that lands later in an older
date folder is not seen: a backfill of that date runs it (or widen the window; `all` lists
everything, as before the window existed).

**The cursor** (`UploadCursor`). Dated files of the window: the version ids of the window's files
already handled (12 hex digits each); a date that leaves the window leaves the cursor. Files at the
top of the input folder (listed every tick) and, with SENSOR_WINDOW_DAYS=all, every file: the
newest modification time seen (`mark`) and the ids of files modified in the LOOKBACK_SECONDS before
it; older ones count as handled. Dagster stores the cursor in every tick row (skipped ticks are
kept 7 days: ~20,000 rows at a 30 s interval), so its size follows the upload rate: ~15 bytes per
file uploaded in the window.

**The backlog**: what is already there when the sensor is turned on (its first tick, an empty
cursor). `baseline` is the newest modification time among those files; a file modified at or before
it is backlog, never a new upload. SENSOR_BACKLOG=skip leaves the backlog alone (only files
uploaded from now on run); `run` (the default) queues a run for each backlog file not yet completed,
date by date (`backlog` in the cursor: the dates still to do; `backlog_after`: where a date that
needed more runs than one tick had goes on), as many per tick as SENSOR_MAX_RUNS_PER_TICK allows.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from batch_pipeline.io import locations, storage
from batch_pipeline.io.storage import ObjectInfo

# Files modified more than this before the newest file seen are taken as handled (files at the top
# of the input folder, or all files with SENSOR_WINDOW_DAYS=all). It has to cover the longest
# upload: S3 dates a multipart upload by its start, and `cp -p`/`rsync -t` keep old local mtimes.
LOOKBACK_SECONDS = 24 * 3600
# Local files modified this recently may still be being written (a plain `cp`): wait a tick.
# S3 objects appear only once complete, so they need no wait.
LOCAL_SETTLE_SECONDS = 5.0
# How far below the newest file present at the first tick the backlog ends (see scan()).
BASELINE_SLACK_SECONDS = 2.0
CURSOR_VERSION = 2
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def version_id(relative: str, etag: str) -> str:
    """12 hex digits naming one version of one file (48 bits: no collision in any real window)."""
    return hashlib.sha256(f"{relative}\0{etag}".encode()).hexdigest()[:12]


@dataclass
class UploadCursor:
    since: float | None = None  # when the sensor's first tick ran (epoch seconds); None: it has not
    mark: float | None = None  # newest modification time seen; None: nothing yet
    seen: set[str] = field(default_factory=set)  # version ids of files handled (see the module doc)
    baseline: float | None = None  # files modified at or before this were there when the sensor was turned on
    backlog: list[str] = field(default_factory=list)  # dates whose backlog runs are still to be requested
    # date -> the last of its backlog files (by URI) whose run is requested: a date whose files
    # needed more runs than one tick had goes on after it
    backlog_after: dict[str, str] = field(default_factory=dict)
    delete: list[str] = field(default_factory=list)  # SQS receipt handles the next tick deletes (queue.py)

    @property
    def fresh(self) -> bool:
        """True for the sensor's first tick (no cursor stored yet)."""
        return self.since is None

    @classmethod
    def parse(cls, raw: str | None) -> "UploadCursor":
        if not raw:
            return cls()
        data = json.loads(raw)
        if data.get("v") == 1:
            # Before the window: everything modified before mark - LOOKBACK counted as handled.
            mark = data["mark"]
            return cls(since=0.0, mark=mark, seen=set(data["seen"]),
                       baseline=None if mark is None else mark - LOOKBACK_SECONDS)
        if data.get("v") != CURSOR_VERSION:
            raise ValueError(f"unknown batch_upload_sensor cursor version: {raw[:80]!r}")
        return cls(since=data["since"], mark=data["mark"], seen=set(data["seen"]), baseline=data.get("baseline"),
                   backlog=list(data.get("backlog", ())), delete=list(data.get("delete", ())),
                   backlog_after=dict(data.get("backlog_after", {})))

    def dumps(self) -> str:
        data = {"v": CURSOR_VERSION, "since": self.since, "mark": self.mark, "seen": sorted(self.seen)}
        if self.baseline is not None:
            data["baseline"] = self.baseline
        if self.backlog:
            data["backlog"] = self.backlog
        after = {d: uri for d, uri in self.backlog_after.items() if d in self.backlog}
        if after:
            data["backlog_after"] = after
        if self.delete:
            data["delete"] = self.delete
        return json.dumps(data, separators=(",", ":"))

    def defer(self, batches: Iterable["NewBatch"]) -> None:
        """Leave `batches` for a later tick: forget them as seen, and keep the mark close enough
        that the look-back still reaches them."""
        for batch in batches:
            self.seen.discard(batch.version)
            if self.mark is not None:
                self.mark = min(self.mark, batch.info.modified + LOOKBACK_SECONDS)


@dataclass(frozen=True)
class NewBatch:
    info: ObjectInfo
    partition: str
    version: str = ""  # version_id of the file (the cursor's name for it)

    @property
    def run_key(self) -> str:
        return f"{self.info.uri}@{self.info.etag}"


@dataclass(frozen=True)
class PartitionRange:
    """The dates that are partitions (inclusive, YYYY-MM-DD)."""

    first: str
    last: str


@dataclass
class Scan:
    """What one listing holds: new files (oldest first), the backlog by date, the next cursor."""

    found: list[NewBatch]
    backlog: dict[str, list[ObjectInfo]]  # date -> files there before the sensor was turned on
    cursor: UploadCursor
    listed: int  # objects listed


def folder_prefix(root: str) -> str:
    """`root` with exactly one trailing separator, spelled as list_objects spells its URIs."""
    return storage.join(root, "x")[:-1]


def watched(uri: str, prefix: str, exclude: str = "") -> str:
    """`uri` relative to the input folder `prefix` when it is a batch file the sensor looks at (not
    hidden, not under the results folder `exclude`), else ""."""
    if not uri.startswith(prefix) or not locations.is_batch_file(uri) or (exclude and uri.startswith(exclude)):
        return ""
    relative = uri[len(prefix):]
    return "" if storage.is_hidden(relative) else relative


def window_dates(partitions: PartitionRange, days: int | None) -> list[str] | None:
    """The dates whose folders a tick lists: the last `days` partitions up to today, newest first;
    None (SENSOR_WINDOW_DAYS=all): every folder."""
    if days is None:
        return None
    last = dt.date.fromisoformat(partitions.last)
    dates = [(last - dt.timedelta(days=i)).isoformat() for i in range(days)]
    return [d for d in dates if d >= partitions.first]


def list_inputs(root: str, window: list[str] | None) -> list[ObjectInfo]:
    """The objects a tick looks at: the top of `root` plus the window's date folders (one listing
    each), or everything under `root` when `window` is None."""
    if window is None:
        return storage.list_objects(root)
    found = storage.list_objects(root, recursive=False)
    for day in window:
        found.extend(storage.list_objects(storage.join(root, day), recursive=False))
    return found


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


@dataclass
class _Listing:
    """One listing's batch files (settled, watched): each one's path under the root, its partition
    (or why it has none), and per (date, batch name) the files that would write one output folder."""

    candidates: list[ObjectInfo]
    relative: dict[str, str]
    placed: dict[str, tuple[str | None, str]]
    writers: dict[tuple[str, str], list[str]]
    windowed: set[str]

    @classmethod
    def of(cls, root: str, objects: list[ObjectInfo], now: float, partitions: PartitionRange, exclude: str,
           window: list[str] | None) -> "_Listing":
        prefix = folder_prefix(root)
        local = not storage.is_s3(root)
        candidates = [o for o in objects
                      if watched(o.uri, prefix, exclude) and not (local and o.modified > now - LOCAL_SETTLE_SECONDS)]
        relative = {o.uri: o.uri[len(prefix):] for o in candidates}
        placed = {o.uri: partition_of(relative[o.uri], o, partitions) for o in candidates}
        # Files of one date with one batch name share the output folder <output>/<date>/<name>/.
        writers: dict[tuple[str, str], list[str]] = {}
        for uri, (partition, _) in placed.items():
            if partition is not None:
                writers.setdefault((partition, locations.batch_name(uri)), []).append(uri)
        return cls(candidates, relative, placed, writers, set(window or ()))

    def in_window(self, info: ObjectInfo) -> bool:
        """Whether it is in a listed date folder (tracked by version id alone, not by the look-back)."""
        parts = self.relative[info.uri].split("/")
        return len(parts) == 2 and parts[0] in self.windowed

    def version(self, info: ObjectInfo) -> str:
        return version_id(self.relative[info.uri], info.etag)


def scan(
    root: str,
    objects: Iterable[ObjectInfo],
    cursor: UploadCursor,
    now: float,
    partitions: PartitionRange,
    log: Callable[[str], None],
    exclude: str = "",
    window: list[str] | None = None,
    backlog_policy: str = "run",
) -> Scan:
    """The batch files not handled yet, the backlog, and the cursor that marks them handled.

    `window`: the dates listed (list_inputs); their files are tracked by version id alone. Files
    outside it (the top of the folder; everything when `window` is None) by the look-back."""
    objects = list(objects)
    listing = _Listing.of(root, objects, now, partitions, exclude, window)
    candidates = listing.candidates
    baseline = cursor.baseline
    if cursor.fresh and candidates:
        # A file uploaded just after this listing can carry the same (second-rounded) time as the
        # newest one listed: the baseline sits a little lower, and the files above it that this
        # tick saw are remembered by id instead.
        baseline = max(o.modified for o in candidates) - BASELINE_SLACK_SECONDS
    found, backlog = _sort_out(listing, cursor, baseline, log)
    newer = [o for o in candidates if baseline is None or o.modified > baseline]
    mark = max([o.modified for o in newer] + ([cursor.mark] if cursor.mark is not None else []), default=None)
    keep_from = mark - LOOKBACK_SECONDS if mark is not None else -math.inf
    seen = {listing.version(o) for o in newer if listing.in_window(o) or o.modified >= keep_from}
    pending = _backlog_dates(backlog, cursor, backlog_policy, log)
    new_cursor = UploadCursor(
        since=now if cursor.fresh else cursor.since, mark=mark, seen=seen, baseline=baseline, backlog=pending,
        backlog_after=dict(cursor.backlog_after), delete=[],
    )
    return Scan(found=found, backlog=backlog, cursor=new_cursor, listed=len(objects))


def _sort_out(listing: _Listing, cursor: UploadCursor, baseline: float | None,
              log: Callable[[str], None]) -> tuple[list[NewBatch], dict[str, list[ObjectInfo]]]:
    """The new batch files (a run each), and the backlog by date: files that were there when the
    sensor was turned on (at or below the baseline). Files seen before, out of the look-back, with no
    partition, or sharing an output folder with another are left, the last two with a log line."""
    fresh = cursor.fresh
    floor = cursor.mark - LOOKBACK_SECONDS if cursor.mark is not None else -math.inf
    found: list[NewBatch] = []
    backlog: dict[str, list[ObjectInfo]] = {}
    for info in sorted(listing.candidates, key=lambda o: (o.modified, o.uri)):
        version = listing.version(info)
        partition, reason = listing.placed[info.uri]
        if fresh or (baseline is not None and info.modified <= baseline):
            if partition is not None:
                backlog.setdefault(partition, []).append(info)
            elif fresh:
                log(f"ignoring {info.uri}: {reason}")
            continue
        if version in cursor.seen or (not listing.in_window(info) and info.modified < floor):
            if partition is not None and partition in cursor.backlog:
                backlog.setdefault(partition, []).append(info)  # seen by the first tick, just above the baseline
            continue
        if partition is None:
            log(f"ignoring {info.uri}: {reason}")
            continue
        name = locations.batch_name(info.uri)
        others = [uri for uri in listing.writers[(partition, name)] if uri != info.uri]
        if others:
            log(
                f"ignoring {info.uri}: {others[0]} is also batch {name!r} of {partition} and the two would "
                "overwrite each other's results; rename one and upload it again"
            )
            continue
        found.append(NewBatch(info, partition, version))
    return found, backlog


def _backlog_dates(backlog: dict[str, list[ObjectInfo]], cursor: UploadCursor, policy: str,
                   log: Callable[[str], None]) -> list[str]:
    """The backlog's dates still to be run: on the first tick all of them (SENSOR_BACKLOG=run) or
    none (skip), said in the log; after it, the cursor's, less those no longer listed."""
    if cursor.fresh:
        pending = sorted(backlog) if policy == "run" else []
        if backlog:
            files = sum(len(v) for v in backlog.values())
            if policy == "run":
                log(f"sensor turned on over {files} batch file(s) already there, on {len(backlog)} date(s): "
                    f"a run per file not yet completed, a few per tick (SENSOR_BACKLOG=run): {', '.join(pending[:10])}"
                    + (" ..." if len(pending) > 10 else ""))
            else:
                log(f"sensor turned on over {files} batch file(s) already there, on {len(backlog)} date(s): "
                    "left alone (SENSOR_BACKLOG=skip); a backfill of their dates runs them")
    else:
        pending = list(cursor.backlog)
    # A backlog date no longer listed (it left the window, or its files were deleted) is dropped.
    gone = [d for d in pending if d not in backlog]
    if gone:
        log(f"backlog date(s) {', '.join(gone)} no longer listed (outside SENSOR_WINDOW_DAYS now, or deleted) "
            "before their run was requested: a backfill of those dates runs them")
    return [d for d in pending if d in backlog]


def already_completed(new: NewBatch, output_root: str) -> bool:
    """True when this very file version was answered in full already (by a backfill, the nightly
    schedule or an earlier run): the check the date runs use, so no run is started for it."""
    return completed(new.info, new.partition, output_root)


def completed(info: ObjectInfo, partition: str, output_root: str) -> bool:
    name = locations.batch_name(info.uri)
    loc = locations.BatchLocation(name, info.uri, locations.default_output(output_root, partition, name), partition)
    return locations.completed_batch(loc, input_etag=info.etag) is not None

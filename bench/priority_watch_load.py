#!/usr/bin/env python3
"""What PriorityWatch costs Dagster's instance when K runs answer at once on one warm engine: one look's
latency, the watchers' CPU and the PostgreSQL server's CPU, for K = 3, 25, 100, over a runs table that
already holds many finished runs.

A script, not a test. From the repository root, with PostgreSQL on 127.0.0.1:5432 (trust auth, user
postgres; TEST_POSTGRES_* as in batch_pipeline_tests/support/postgres_db.py say otherwise):

    .venv/bin/python bench/priority_watch_load.py                      # K = 3, 25, 100; 2,000 finished runs (~3 min)
    .venv/bin/python bench/priority_watch_load.py --sqlite             # also the local SQLite instance, same K (~5 min)
    .venv/bin/python bench/priority_watch_load.py --pooled             # also each watcher on one held connection (~4 min)
    .venv/bin/python bench/priority_watch_load.py --pooled --sqlite    # both (6.5 min on 2 idle cores)
    .venv/bin/python bench/priority_watch_load.py --watchers 85 --pooled   # the highest K a held connection each fits (~2 min)
    .venv/bin/python bench/priority_watch_load.py --watchers 3,8 --seconds 10 --finished 500 --json /tmp/pw.json

What a run does (batch_pipeline/defs/run_watch.py): while it answers on a warm engine it carries the tag
batch_pipeline/answering_on = the engine's URL, and a thread calls PriorityWatch.look every
PRIORITY_POLL_SECONDS (0.25 s; 1 s before 2026-12-07), or every K / PRIORITY_LOOKS_PER_SECOND (25) s when it saw K runs answering
there and that is longer (PriorityWatch.interval; --fixed-poll: the poll whatever K, as before):
instance.get_runs(RunsFilter(statuses=[STARTED], tags={ANSWERING_TAG: url}), limit=100). Here:

- a fresh database pw_bench_<pid> is created (dropped at the end) and the production instance settings
  (deploy/dagster.yaml, DAGSTER_POSTGRES_* pointing at it) are loaded from a temporary DAGSTER_HOME, as
  batch_pipeline_tests/system/test_postgres.py does;
- the runs table is filled with --finished finished runs (SUCCESS, some FAILURE and CANCELED) carrying the
  tags file and Batch API runs carry (input_uri, batch_name, date, engine, the priority tags of
  config/priority.py, tenant for API runs) and the run config of defs/jobs.batch_run_config; those that
  answered on a warm engine keep answering_on="" (what PriorityWatch leaves), a few crashed ones still the
  URL; plus --others started runs answering on another engine's URL;
- for each K: K started runs answering on the engine's URL are added (priorities: one at 5, the rest 0 to 2,
  so most watchers see one run above them), then K watcher processes (forked, each with its own
  DagsterInstance.get() and its own GIL, as each run is its own process) each run PriorityWatch.look of
  its own run on its own instance as the watch thread does: wait its interval, look, again, from
  a random phase within the first second, for --seconds; then the K runs are deleted again, so every K
  sees the same history.

Printed per K: looks done, a look's median / p95 / max latency (wall time in the watcher, which includes
a new PostgreSQL connection per look: dagster-postgres's run storage uses NullPool outside the webserver);
the watchers' CPU-seconds per second (their summed process time over the loop) and per look; the
PostgreSQL server's CPU-seconds per second over the window (every `postgres` process in /proc: the
postmaster's own and reaped children's time plus each live backend's utime+stime, end minus start; the
backends of exited connections are counted through the postmaster's cutime/cstime) and per look, minus
nothing: the idle server's rate over --idle-seconds before the first K is printed beside it; sessions,
transactions and tuples read per look (pg_stat_database of the bench database); host CPU busy over the
window (/proc/stat) and the load average at its end. Before the loads, one look's anatomy in this process,
sequential and unloaded: the whole look, the query alone on an open connection, and a connection opened
and closed (NullPool's cost), medians of 20; plus the look's SQL and its EXPLAIN ANALYZE at each K.

With --pooled each K also runs with every watcher's run storage holding one connection for the run's life
(optimize_for_webserver's pool of 1, what Dagster's webserver does) instead of NullPool's new connection per
look: what a pooled watch would save, and what it would hold (K connections; K beyond the server's
max_connections room is skipped). With --sqlite the same K run against DagsterInstance.local_temp (SQLite
files; every watcher opens the same directory): no server process, so only latency and the watchers' CPU.

Caveats (printed): the runs' bodies carry tags and run config but not the code origins and snapshot ids a
launched run's body has (larger bodies cost each look more to unpickle); no event_logs rows are written
(the look never reads them, but they share the server's cache); the daemon, webserver and the runs' own
writes (events, tags) that a real deployment adds to the same server are absent; on 2 cores at K=100 the
watchers compete with each other and the server for CPU, so latency includes queueing on the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import dagster as dg

from batch_pipeline.config.priority import priority_tags
from batch_pipeline.defs.jobs import ENGINE_TAG, batch_run_config
from batch_pipeline.defs.run_watch import ANSWERING_TAG, PRIORITY_LOOKS_PER_SECOND, PRIORITY_POLL_SECONDS, PriorityWatch
from batch_pipeline_tests.support.postgres_db import PG_HOST, PG_PASSWORD, PG_PORT, PG_USER, connect
from common import loadavg, pct, say, write_json

URL = "http://engine-a:8000/v1"  # the warm engine the K runs answer on
OTHER_URL = "http://engine-b:8000/v1"  # another engine (another model)
TICK = os.sysconf("SC_CLK_TCK")


# =============================================================================================
# PostgreSQL: the bench database, its statistics, the server's CPU
# =============================================================================================


def pg_sql(dbname: str, sql: str, params: tuple = ()) -> list[tuple]:
    conn = connect(dbname)
    try:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def pg_db_stats(dbname: str) -> dict[str, int]:
    """pg_stat_database's counters for the bench database (PostgreSQL 14+ for `sessions`)."""
    (row,) = pg_sql(dbname, "SELECT sessions, xact_commit, xact_rollback, tup_returned, tup_fetched, blks_hit, "
                            "blks_read FROM pg_stat_database WHERE datname = %s", (dbname,))
    return dict(zip(("sessions", "xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "blks_hit",
                     "blks_read"), (int(x or 0) for x in row)))


def _stat(pid: str) -> tuple[str, int, list[int]] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime fields 14..17
    return comm, int(rest[1]), [int(x) for x in rest[11:15]]


def postgres_cpu_seconds() -> tuple[float, int]:
    """CPU-seconds used so far by the PostgreSQL server (every process named postgres): each postmaster's
    own utime+stime plus its reaped children's (cutime+cstime: the backends of closed connections), plus
    every live child's utime+stime. Also how many postgres processes are alive."""
    procs = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            st = _stat(pid)
            if st and st[0] == "postgres":
                procs[int(pid)] = st
    ticks = 0
    for pid, (_, ppid, (utime, stime, cutime, cstime)) in procs.items():
        ticks += utime + stime
        if ppid not in procs:  # a postmaster
            ticks += cutime + cstime
    return ticks / TICK, len(procs)


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host so far (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


# =============================================================================================
# The instances
# =============================================================================================


def postgres_home(dbname: str, tmp: Path) -> Path:
    """A DAGSTER_HOME holding deploy/dagster.yaml, and the DAGSTER_POSTGRES_* variables it reads (set in
    this process; the forked watchers inherit them)."""
    home = tmp / "dagster_home_pg"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    os.environ.update({"DAGSTER_HOME": str(home), "DAGSTER_POSTGRES_USER": PG_USER,
                       "DAGSTER_POSTGRES_PASSWORD": PG_PASSWORD, "DAGSTER_POSTGRES_HOSTNAME": PG_HOST,
                       "DAGSTER_POSTGRES_DB": dbname, "DAGSTER_POSTGRES_PORT": str(PG_PORT)})
    return home


def open_instance(kind: str, home: Path) -> dg.DagsterInstance:
    """The instance a run worker would have: DAGSTER_HOME's (PostgreSQL), or the SQLite files of `home`."""
    if kind == "postgres":
        return dg.DagsterInstance.get()
    from dagster._core.instance.ref import InstanceRef

    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


# =============================================================================================
# The runs
# =============================================================================================


def run_tags(i: int, warm: bool, url: str, priority: int, api: bool, answering: str | None) -> dict[str, str]:
    """The tags a file run (the sensor's, defs/sensors.file_tags) or a Batch API run carries."""
    date = f"2026-{1 + i % 12:02d}-{1 + i % 28:02d}"
    name = f"batch-{i:06d}"
    tags = {"batch_pipeline/input_uri": f"s3://bench-bucket/incoming/{date}/{name}.jsonl",
            "batch_pipeline/batch_name": name, "batch_pipeline/date": date,
            ENGINE_TAG: url if warm else "in-process", **priority_tags(priority, i % 7 if api else 0)}
    if api:
        tags.update({"batch_pipeline/api_batch_id": f"batch_{uuid.uuid4().hex}", "batch_pipeline/tenant": f"tenant-{i % 5}",
                     "dagster/partition": date})
    if answering is not None:
        tags[ANSWERING_TAG] = answering
    return tags


def make_run(i: int, status: dg.DagsterRunStatus, tags: dict[str, str]) -> dg.DagsterRun:
    uri = tags["batch_pipeline/input_uri"]
    config = batch_run_config(input_uri=uri, output_uri=uri.replace("/incoming/", "/output/").rsplit("/", 1)[0],
                              model_versions="")
    return dg.DagsterRun(job_name="batch_file_job", run_id=str(uuid.uuid4()), status=status, tags=tags,
                         run_config=config)


def fill_history(instance: dg.DagsterInstance, finished: int, others: int, seed: int, threads: int) -> dict[str, int]:
    """`finished` finished runs (about half answered on a warm engine: answering_on blank, 1 in 50 of
    those crashed with the URL still on) and `others` started runs answering on OTHER_URL."""
    rnd = random.Random(seed)
    counts = {"finished": 0, "warm_blank": 0, "warm_stale_url": 0, "others": 0}
    statuses = [dg.DagsterRunStatus.SUCCESS] * 8 + [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
    runs = []
    for i in range(finished):
        warm = rnd.random() < 0.5
        answering = None
        status = rnd.choice(statuses)
        if warm:
            stale = rnd.random() < 0.02
            answering = URL if stale else ""
            status = dg.DagsterRunStatus.FAILURE if stale else status
            counts["warm_stale_url" if stale else "warm_blank"] += 1
        runs.append(make_run(i, status, run_tags(i, warm, rnd.choice([URL, OTHER_URL]), rnd.randint(-2, 5),
                                                 rnd.random() < 0.3, answering)))
        counts["finished"] += 1
    for i in range(others):
        runs.append(make_run(finished + i, dg.DagsterRunStatus.STARTED,
                             run_tags(finished + i, True, OTHER_URL, rnd.randint(0, 9), True, OTHER_URL)))
        counts["others"] += 1
    with ThreadPoolExecutor(max_workers=threads) as pool:  # PostgreSQL: a connection per add_run (NullPool), a few at once
        list(pool.map(instance.add_run, runs))
    return counts


def add_answering(instance: dg.DagsterInstance, k: int, base: int, seed: int) -> list[tuple[str, int]]:
    """K started runs answering on URL: one of priority 5, the rest 0 to 2. [(run_id, priority)]."""
    rnd = random.Random(seed + k)
    out = []
    for j in range(k):
        priority = 5 if j == 0 else rnd.randint(0, 2)
        run = make_run(base + j, dg.DagsterRunStatus.STARTED,
                       run_tags(base + j, True, URL, priority, rnd.random() < 0.5, URL))
        instance.add_run(run)
        out.append((run.run_id, priority))
    return out


# =============================================================================================
# One watcher (a forked process)
# =============================================================================================


FIXED_POLL = False
POLL: float | None = None  # --poll: the watch's poll instead of PRIORITY_POLL_SECONDS


def watcher(kind: str, pooled: bool, home: str, run_id: str, ready: Any, go: Any, start_at: Any, seconds: float,
            phase: float, results: Any) -> None:
    """A run's watch thread, in its own process: its own instance and its own run, then look every
    PriorityWatch.interval() (--fixed-poll: PRIORITY_POLL_SECONDS) from start_at + phase until
    start_at + seconds."""
    out: dict[str, Any] = {"run_id": run_id, "latencies": [], "errors": 0, "outranked": 0, "error": None}
    try:
        instance = open_instance(kind, Path(home))
        if pooled:  # one connection held for the run's life, as the webserver's run storage does
            instance.run_storage.optimize_for_webserver(statement_timeout=15000, pool_recycle=3600, max_overflow=0)
        run = instance.get_run_by_id(run_id)
        watch = PriorityWatch(instance, run, URL, poll=POLL)
        ready.put(run_id)
        go.wait()
        begin, end = start_at.value + phase, start_at.value + seconds
        time.sleep(max(0.0, begin - time.time()))
        cpu0 = time.process_time()
        while True:
            t0 = time.perf_counter()
            try:
                above = watch.look()
                out["outranked"] += above is not None
            except Exception as e:  # noqa: BLE001 - counted, as the watch thread would ask again
                out["errors"] += 1
                out["error"] = repr(e)[:300]
            out["latencies"].append(time.perf_counter() - t0)
            # The watch thread's wait between looks: its interval (the poll, longer among many runs),
            # or with --fixed-poll the poll alone, as before run_watch.PRIORITY_LOOKS_PER_SECOND.
            wait = watch.poll if FIXED_POLL else watch.interval()
            if time.time() + wait > end:
                break
            time.sleep(wait)
        out["cpu"] = time.process_time() - cpu0
    except Exception as e:  # noqa: BLE001 - reported by the parent
        out["error"] = f"setup: {e!r}"[:300]
        ready.put(run_id)
    results.put(out)


def run_watchers(kind: str, pooled: bool, home: Path, runs: list[tuple[str, int]], seconds: float, seed: int,
                 pg_db: str | None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    rnd = random.Random(seed)
    procs = [ctx.Process(target=watcher, args=(kind, pooled, str(home), run_id, ready, go, start_at, seconds,
                                               rnd.uniform(0, POLL or PRIORITY_POLL_SECONDS), results), daemon=True)
             for run_id, _ in runs]
    t_spawn = time.perf_counter()
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    spawn_seconds = time.perf_counter() - t_spawn
    time.sleep(1.0)  # let the instance set-ups' backends finish and their stats flush
    db0 = pg_db_stats(pg_db) if pg_db else None
    start_at.value = time.time() + 0.5
    time.sleep(max(0.0, start_at.value - time.time()))
    pg0, host0, wall0 = postgres_cpu_seconds()[0], host_cpu(), time.perf_counter()
    go.set()
    outs = [results.get(timeout=seconds + 300) for _ in procs]
    pg1, host1, wall1 = postgres_cpu_seconds()[0], host_cpu(), time.perf_counter()
    load = loadavg()
    for p in procs:
        p.join(timeout=30)
    time.sleep(1.0)  # exited backends' statistics reach pg_stat_database
    db1 = pg_db_stats(pg_db) if pg_db else None
    window = wall1 - wall0
    lat = [x for o in outs for x in o["latencies"]]
    looks = len(lat)
    cpu = sum(o.get("cpu", 0.0) for o in outs)
    errors = [o["error"] for o in outs if o["error"]]
    row = {
        "kind": kind + ("+pool" if pooled else ""), "k": len(runs), "window_s": round(window, 2),
        "spawn_s": round(spawn_seconds, 2),
        "looks": looks, "looks_per_s": round(looks / window, 2),
        "median_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
        "p95_ms": round(pct(lat, 95) * 1000, 2) if lat else None,
        "max_ms": round(max(lat) * 1000, 2) if lat else None,
        "watchers_cpu_per_s": round(cpu / window, 3),
        "watchers_cpu_ms_per_look": round(cpu / looks * 1000, 2) if looks else None,
        "look_errors": sum(o["errors"] for o in outs), "error_samples": errors[:3],
        "outranked_looks": sum(o["outranked"] for o in outs),
        "host_busy": round((host1[0] - host0[0]) / max(1, host1[1] - host0[1]), 3),
        "host_cpu_per_s": round((host1[0] - host0[0]) / TICK / window, 3),
        "loadavg_end": load,
    }
    # What neither the watchers nor the server used: this process, the kernel's own threads, and anything
    # else running on the host (another job's load shows here).
    row["rest_cpu_per_s"] = round(row["host_cpu_per_s"] - row["watchers_cpu_per_s"] - (pg1 - pg0) / window
                                  if pg_db else row["host_cpu_per_s"] - row["watchers_cpu_per_s"], 3)
    if pg_db:
        pg = pg1 - pg0
        delta = {key: db1[key] - db0[key] for key in db0}
        row.update({"pg_cpu_per_s": round(pg / window, 3),
                    "pg_cpu_ms_per_look": round(pg / looks * 1000, 2) if looks else None,
                    "db_delta": delta,
                    "sessions_per_look": round(delta["sessions"] / looks, 2) if looks else None,
                    "tuples_returned_per_look": round(delta["tup_returned"] / looks, 1) if looks else None,
                    "tuples_fetched_per_look": round(delta["tup_fetched"] / looks, 1) if looks else None,
                    "blocks_hit_per_look": round(delta["blks_hit"] / looks, 1) if looks else None})
    return row


# =============================================================================================
# One look's anatomy, in this process
# =============================================================================================


def anatomy(instance: dg.DagsterInstance, run_id: str, repeats: int = 20) -> dict[str, float]:
    """Medians (ms) of: the whole look; the query and fetch alone on an open connection; deserializing the
    rows it returns; a run-storage connection opened and closed (plus SELECT 1)."""
    import sqlalchemy as sa
    from dagster._core.storage.sqlalchemy_compat import db_fetch_mappings

    run = instance.get_run_by_id(run_id)
    watch = PriorityWatch(instance, run, URL)
    storage = instance.run_storage
    filters = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED], tags={ANSWERING_TAG: URL})
    query = storage._runs_query(filters, limit=100)  # noqa: SLF001 - the query get_runs runs
    whole, fetch, decode, connect = [], [], [], []
    with storage.connect() as conn:
        for _ in range(repeats):
            t0 = time.perf_counter()
            rows = db_fetch_mappings(conn, query)  # what storage.fetchall does inside its connection
            fetch.append(time.perf_counter() - t0)
    for _ in range(repeats):
        t0 = time.perf_counter()
        storage._rows_to_runs(rows)  # noqa: SLF001
        decode.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with storage.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        connect.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        watch.look()
        whole.append(time.perf_counter() - t0)
    ms = lambda xs: round(statistics.median(xs) * 1000, 2)  # noqa: E731
    return {"look_ms": ms(whole), "query_fetch_ms": ms(fetch), "unpickle_ms": ms(decode), "connect_ms": ms(connect),
            "rows": len(rows)}


def look_sql(instance: dg.DagsterInstance) -> str:
    from sqlalchemy.dialects import postgresql

    filters = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED], tags={ANSWERING_TAG: URL})
    query = instance.run_storage._runs_query(filters, limit=100)  # noqa: SLF001
    return str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))


# =============================================================================================
# Report
# =============================================================================================


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    print()
    print(f"PriorityWatch.look under load: {meta['cpus']} CPU(s), {meta['finished']:,} finished runs + "
          f"{meta['others']} started on another engine; each watcher looks every "
          f"{f'{POLL or PRIORITY_POLL_SECONDS:g} s' if FIXED_POLL else f'max({POLL or PRIORITY_POLL_SECONDS:g} s, K / {PRIORITY_LOOKS_PER_SECOND:g})'} "
          f"for {meta['seconds']:g} s; {meta['when']}")
    print(f"PostgreSQL {meta.get('pg_version', '?')}; idle server before the loads: "
          f"{meta.get('pg_idle_cpu_per_s', float('nan')):.4f} CPU-s/s over {meta['idle_seconds']:g} s; "
          f"run body {meta.get('body_bytes', '?')} B on average")
    head = (f"{'instance':<13} {'K':>4} {'looks':>6} {'looks/s':>8} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} "
            f"{'watch CPU/s':>11} {'watch ms/look':>13} {'pg CPU/s':>9} {'pg ms/look':>10} {'sess/look':>9} "
            f"{'tup ret/look':>12} {'host busy':>9} {'rest CPU/s':>10} {'errors':>6}  loadavg at end")
    print(head)
    print("-" * len(head))
    for r in rows:
        pg = r["kind"].startswith("postgres")
        print(f"{r['kind']:<13} {r['k']:>4} {r['looks']:>6} {r['looks_per_s']:>8.2f} {r['median_ms']:>10.2f} "
              f"{r['p95_ms']:>8.2f} {r['max_ms']:>8.2f} {r['watchers_cpu_per_s']:>11.3f} "
              f"{r['watchers_cpu_ms_per_look']:>13.2f} "
              f"{(format(r['pg_cpu_per_s'], '.3f') if pg else '-'):>9} "
              f"{(format(r['pg_cpu_ms_per_look'], '.2f') if pg else '-'):>10} "
              f"{(format(r['sessions_per_look'], '.2f') if pg else '-'):>9} "
              f"{(format(r['tuples_returned_per_look'], '.1f') if pg else '-'):>12} "
              f"{r['host_busy']:>9.0%} {r['rest_cpu_per_s']:>10.3f} {r['look_errors']:>6}  {r['loadavg_end']}")
    print()
    print("sanity: looks that named a run of higher priority (every watcher but the priority-5 one should):")
    for r in rows:
        print(f"  {r['kind']:<13} K={r['k']:<4} {r['outranked_looks']} of {r['looks']} looks; watchers ready in "
              f"{r['spawn_s']:.1f} s" + (f"; errors e.g. {r['error_samples']}" if r["error_samples"] else ""))
    if meta.get("pool_skipped"):
        print(f"postgres+pool skipped at K={meta['pool_skipped']}: that many held connections do not fit the server's "
              f"max_connections={meta.get('max_connections')} (less the reserved ones and a margin of 10)")
    if meta.get("anatomy"):
        print()
        print("one look's anatomy, in this process, sequential and unloaded (medians of 20, ms):")
        print(f"  {'instance':<9} {'K':>4} {'rows':>5} {'look':>8} {'query+fetch':>12} {'unpickle':>9} {'connect':>8}")
        for a in meta["anatomy"]:
            print(f"  {a['kind']:<9} {a['k']:>4} {a['rows']:>5} {a['look_ms']:>8.2f} {a['query_fetch_ms']:>12.2f} "
                  f"{a['unpickle_ms']:>9.2f} {a['connect_ms']:>8.2f}")
        print("  (query+fetch on a connection already open; unpickle = the rows into DagsterRuns; connect = a run-storage "
              "connection opened, SELECT 1, closed: NullPool opens one per look)")
    if meta.get("explain"):
        print()
        print("the look's SQL (PostgreSQL):")
        print("  " + meta["sql"].replace("\n", "\n  "))
        for k, plan in meta["explain"].items():
            print(f"EXPLAIN ANALYZE at K={k}:")
            print("  " + "\n  ".join(plan))
    print()
    print("notes: latency is wall time in the watcher around PriorityWatch.look (connection, query, unpickling); "
          "watch CPU = the watchers' summed process time over their loops; pg CPU = every postgres process "
          "(backends included, also the reaped ones), end minus start of the window, nothing subtracted (the idle "
          "rate above is the background); sess/look = pg_stat_database sessions per look (1 = a new connection "
          "each time); tup ret/look = pg_stat_database tup_returned per look, catalog reads of new backends included "
          "(the stats reader's own connection, and with +pool the held connections' set-up flushed late, add a "
          "little); host busy = the whole host's CPU over the window (of all cores); rest CPU/s = the host's CPU-s/s "
          "less the watchers' and the server's (this process, kernel threads, softirq, and any other job: a high "
          "value means the figures were shared). Run bodies here lack the code origins "
          "and snapshot ids of a launched run; no event logs are written; no daemon, webserver or run writes share "
          "the server.")


# =============================================================================================


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--watchers", default="3,25,100", help="K values, comma-separated (default 3,25,100)")
    p.add_argument("--finished", type=int, default=2000, help="finished runs in the runs table (default 2000)")
    p.add_argument("--others", type=int, default=5, help="started runs answering on another engine (default 5)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds each K's watchers look (default 30)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="seconds the idle server's CPU is read (default 5)")
    p.add_argument("--pooled", action="store_true",
                   help="also PostgreSQL with each watcher holding one connection (the run storage's "
                        "optimize_for_webserver pool) instead of NullPool's one per look; K above the server's "
                        "max_connections room is skipped")
    p.add_argument("--sqlite", action="store_true", help="also the local SQLite instance (DagsterInstance.local_temp)")
    p.add_argument("--no-postgres", action="store_true", help="SQLite only (with --sqlite)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--fixed-poll", action="store_true",
                   help="each watcher looks every PRIORITY_POLL_SECONDS whatever K (the watch before it spaced its "
                        "looks by the runs it sees: PriorityWatch.interval)")
    p.add_argument("--poll", type=float, default=None,
                   help="the watch's poll in seconds (default PRIORITY_POLL_SECONDS, 0.25; --poll 1 is the pace before "
                        "2026-12-07)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    args.ks = [int(x) for x in args.watchers.split(",") if x.strip()]
    if not args.ks or min(args.ks) < 1 or max(args.ks) > 100:
        p.error("--watchers: 1 to 100 each (a look reads at most 100 runs)")
    args.kinds = ([] if args.no_postgres else ["postgres"]) + (["sqlite"] if args.sqlite else [])
    if not args.kinds:
        p.error("nothing to measure: --no-postgres needs --sqlite")
    return args


def measure_ks(kind: str, instance: Any, home: Path, args: argparse.Namespace, meta: dict[str, Any],
               dbname: str, pool_room: int) -> list[dict[str, Any]]:
    """Each K in turn on one instance: K answering runs added, their watchers' window (plain, and
    pooled with --pooled), then the runs deleted again."""
    rows: list[dict[str, Any]] = []
    ks = args.ks
    base = args.finished + args.others
    for k in ks:
        runs = add_answering(instance, k, base, args.seed)
        base += k
        if kind == "postgres":
            pg_sql(dbname, "ANALYZE")
        a = anatomy(instance, runs[-1][0])
        meta["anatomy"].append({"kind": kind, "k": k, **a})
        say(f"{kind} K={k}: unloaded look {a['look_ms']} ms (query+fetch {a['query_fetch_ms']}, "
            f"unpickle {a['unpickle_ms']}, connect {a['connect_ms']})")
        for pooled in ([False, True] if kind == "postgres" and args.pooled else [False]):
            if pooled and k > pool_room:
                say(f"postgres+pool K={k}: skipped: {k} held connections exceed the server's room "
                    f"({pool_room}: max_connections less reserved and a margin)")
                meta["pool_skipped"].append(k)
                continue
            label = kind + ("+pool" if pooled else "")
            say(f"{label} K={k}: {k} watchers for {args.seconds:g} s ...")
            row = run_watchers(kind, pooled, home, runs, args.seconds, args.seed + k,
                               dbname if kind == "postgres" else None)
            rows.append(row)
            say(f"{label} K={k}: {row['looks']} looks, median {row['median_ms']} ms, p95 {row['p95_ms']} ms, "
                f"watchers {row['watchers_cpu_per_s']} CPU-s/s, rest {row['rest_cpu_per_s']} CPU-s/s" +
                (f", postgres {row['pg_cpu_per_s']} CPU-s/s, {row['sessions_per_look']} sessions/look"
                 if kind == "postgres" else "") + f", host busy {row['host_busy']:.0%}, load {row['loadavg_end']}")
        if kind == "postgres":
            meta["explain"][k] = [r[0] for r in pg_sql(dbname, "EXPLAIN (ANALYZE, BUFFERS) " + meta["sql"])]
        for run_id, _ in runs:
            instance.delete_run(run_id)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    global FIXED_POLL, POLL
    FIXED_POLL = args.fixed_poll  # read by the forked watchers
    POLL = args.poll
    kinds = args.kinds

    meta: dict[str, Any] = {"cpus": os.cpu_count(), "finished": args.finished, "others": args.others,
                            "seconds": args.seconds, "idle_seconds": args.idle_seconds, "anatomy": [], "explain": {},
                            "pool_skipped": [],
                            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg_start": loadavg()}
    say(f"load average at start: {meta['loadavg_start']}")
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="pw_bench_"))
    dbname = f"pw_bench_{os.getpid()}"
    created = False
    pool_room = 0
    saved_env = {name: os.environ.get(name) for name in (
        "DAGSTER_HOME", "DAGSTER_POSTGRES_USER", "DAGSTER_POSTGRES_PASSWORD", "DAGSTER_POSTGRES_HOSTNAME",
        "DAGSTER_POSTGRES_DB", "DAGSTER_POSTGRES_PORT")}
    try:
        for kind in kinds:
            if kind == "postgres":
                pg_sql("postgres", f'CREATE DATABASE "{dbname}"')
                created = True
                meta["pg_version"] = pg_sql(dbname, "SHOW server_version")[0][0]
                home = postgres_home(dbname, tmp)
                instance = dg.DagsterInstance.get()
                assert type(instance.run_storage).__name__ == "PostgresRunStorage", type(instance.run_storage)
                say(f"database {dbname}: idle server CPU over {args.idle_seconds:g} s ...")
                c0, w0 = postgres_cpu_seconds()[0], time.perf_counter()
                time.sleep(args.idle_seconds)
                meta["pg_idle_cpu_per_s"] = (postgres_cpu_seconds()[0] - c0) / (time.perf_counter() - w0)
                limit, reserved = (int(pg_sql(dbname, f"SHOW {name}")[0][0])
                                   for name in ("max_connections", "superuser_reserved_connections"))
                pool_room = limit - reserved - 10
                meta["max_connections"] = limit
            else:
                home = tmp / "dagster_home_sqlite"
                home.mkdir()
                # Dagster's defaults (SQLite files in `home`), telemetry off as in the project's dagster.yaml
                (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
                instance = dg.DagsterInstance.local_temp(str(home))
            say(f"{kind}: filling the runs table: {args.finished:,} finished runs, {args.others} started elsewhere ...")
            t0 = time.perf_counter()
            counts = fill_history(instance, args.finished, args.others, args.seed, 4 if kind == "postgres" else 1)
            say(f"{kind}: filled in {time.perf_counter() - t0:.1f} s: {counts}")
            if kind == "postgres":
                pg_sql(dbname, "VACUUM ANALYZE")
                meta["body_bytes"] = int(pg_sql(dbname, "SELECT avg(length(run_body)) FROM runs")[0][0])
                meta["sql"] = look_sql(instance)
            rows += measure_ks(kind, instance, home, args, meta, dbname, pool_room)
            instance.dispose()
        report(rows, meta)
        if args.json:
            write_json(args.json, {"meta": meta, "rows": rows})
    finally:
        if created:
            pg_sql("postgres", f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
            say(f"dropped {dbname}")
        shutil.rmtree(tmp, ignore_errors=True)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

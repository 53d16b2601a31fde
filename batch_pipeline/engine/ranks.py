"""One batch over DATA_PARALLEL_SIZE engines: each rank a process of its own, fed from one stream.

vLLM's answer for offline data parallelism is one process per rank (`LLM(data_parallel_size>1)`
is refused offline). Here the run process keeps the one stream of pending requests and the
checkpoints; each rank process builds an ordinary `Engines` on its own GPUs (or CPU cores, see
placement.py) and asks for more requests whenever its engine has room, so a slow rank, or a run
of long prompts on one rank, never holds the others: a rank that is behind simply asks less.

Every answer comes back to the run process, which checkpoints it as with one engine, so
exactly-once, resume and cancellation are unchanged. A rank that dies (killed, out of memory, a
crashed driver) fails the stream with its rank number and exit code, after every answer it sent
before dying has been handed on; the other ranks are stopped, and the step's retry resumes from
the checkpoints. No rank outlives the run: they are stopped when the run ends, fails or is
cancelled, and each also ends itself when the run process disappears, even by SIGKILL (a pidfd on
the run process, PR_SET_PDEATHSIG, and the end of its pipe).

Messages, run process -> rank: ("batch", batch_id, created), ("requests", [BatchRequest]) or
("end",) answering each ("want", n), ("close",).
Rank -> run process: ("want", n), ("log", text, load_seconds), ("answer", Answer),
("batch_done", load_seconds, peak memory MB), ("error", traceback text).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from batch_pipeline import contract
from batch_pipeline.engine.placement import RankPlan
from batch_pipeline.contract.lines import Answer
from batch_pipeline.contract.prompts import SharesPrefix
from batch_pipeline.config.settings import EngineSettings

# A rank asks for one request before its engine is built, then WANT at a time, and keeps at most
# PREFETCH waiting beyond what its engine holds: so the first rank to load does not take a small
# batch whole, and a rank that is behind holds back little.
WANT = 16
PREFETCH = 16
# How long a stopped rank may take to shut its engine down before it is killed.
STOP_SECONDS = 30.0
# Requests a rank's engine holds: 2 x BATCH_SIZE (at least 8), not one engine's 4 x (at least 64):
# enough to keep its scheduler full, and little left on one rank when the others have run dry.
RANK_QUEUE = (2, 8)
RANK_TITLE = "batch-pipeline::rank"  # process title of rank N: RANK_TITLE + "N"
# Ranks are forked from a server process that imported vLLM once (multiprocessing's forkserver,
# preloading these modules): N ranks pay the import (10-30 s of CPU each) once instead of N times
# side by side, and the ranks a step's retry starts again pay nothing. The server imports and never
# builds an engine, so it holds no GPU context that a fork could carry (vLLM forks its own engine
# processes after the same import). It ends after its last rank, and each rank ends with the run
# process (_die_with_parent). RANK_START_METHOD=spawn, or
# a platform without forkserver: each rank is a new interpreter that imports vLLM itself.
RANK_PRELOAD = ["batch_pipeline.engine.ranks", "batch_pipeline.engine.rank_server"]


class RankFailed(RuntimeError):
    """A rank process died or raised; the message names the rank, its devices and exit code."""


class _Rank:
    def __init__(self, plan: RankPlan, process: multiprocessing.process.BaseProcess, conn: Connection):
        self.plan, self.process, self.conn = plan, process, conn
        self.load_seconds = 0.0  # its engine's build, as the rank reports it
        self.startup_seconds: float | None = None  # from the ranks' start to its first message
        self.peak_memory_mb = 0.0
        self.in_batch = False
        self.outstanding = 0  # requests handed to it and not answered yet (this batch)
        self.wants: deque[int] = deque()  # how many it asked for, per "want" not answered yet

    def exit_description(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return f"was killed by {name}"
        return f"exited with code {code}"


class _Feeder:
    """Hands requests to the ranks that ask ("want"), one reply per want, deferred while the rank
    already holds its share.

    A rank's share is the work left (requests not handed out yet, plus those the ranks hold) split
    evenly over the ranks: the first rank to load cannot take a small batch whole, nor the last
    few hundred requests of a large one while the others run dry. A rank that answers faster comes
    back sooner and so still does more. Without `expected` (the stream's length), a rank gets what
    it asks for.

    From a planned stream (ORDER=planned: a contract.prompts.SharesPrefix, which says how much
    prompt prefix each request shares with the one before it), a reply of n requests may end early, after
    n/2 of them at the least, where the next request shares the least prefix with the one before
    it: a document's questions go to one rank, which computes its prefix once, instead of two.
    """

    def __init__(self, source: Iterator[contract.BatchRequest], expected: int | None, ranks: int):
        self.source, self.expected, self.ranks = source, expected, ranks
        self.handed_out = 0
        self.exhausted = False
        self._back: deque[tuple[contract.BatchRequest, int]] = deque()  # taken, not handed out yet
        self._cuts = isinstance(source, SharesPrefix)

    def _next(self) -> tuple[contract.BatchRequest, int] | None:
        """The next request and the prefix levels it shares with the one before it."""
        if self._back:
            return self._back.popleft()
        item = next(self.source, None)
        return None if item is None else (item, self.source.shared if isinstance(self.source, SharesPrefix) else 0)

    def _take(self, allowed: int) -> list[contract.BatchRequest]:
        taken: list[tuple[contract.BatchRequest, int]] = []
        while len(taken) < allowed:
            item = self._next()
            if item is None:
                self.exhausted = True
                break
            taken.append(item)
        if self._cuts and allowed > 1 and len(taken) == allowed:
            after = self._next()
            if after is not None:
                taken.append(after)
                # Cut before the request sharing the least with its predecessor; the latest such place.
                cut = min(range(allowed, (allowed + 1) // 2 - 1, -1), key=lambda c: taken[c][1])
                self._back.extendleft(reversed(taken[cut:]))
                taken = taken[:cut]
        return [request for request, _ in taken]

    def _share(self, ranks: list[_Rank]) -> int | None:
        if self.expected is None:
            return None
        left = max(self.expected - self.handed_out, 0) + sum(r.outstanding for r in ranks)
        return max(-(-left // self.ranks), 1)

    def serve(self, ranks: list[_Rank]) -> None:
        for rank in ranks:
            while rank.wants:
                if self.exhausted:
                    rank.conn.send(("end",))
                    rank.wants.popleft()
                    continue
                share = self._share(ranks)
                asked = rank.wants[0]
                allowed = asked if share is None else min(asked, share - rank.outstanding)
                if allowed <= 0:
                    break  # answered once this rank has handed back some of what it holds
                items = self._take(allowed)
                rank.conn.send(("requests", items) if items else ("end",))
                rank.wants.popleft()
                rank.outstanding += len(items)
                self.handed_out += len(items)


class RankedEngines:
    """The `Engines` interface (stream, load_seconds, close) over DATA_PARALLEL_SIZE rank processes,
    started on the first batch and kept for the run's later batches."""

    takes_at_once = 1  # as Engines: the plan decides the order
    figures = None  # as Engines: no warm engine's figures

    def __init__(
        self,
        settings: EngineSettings,
        plans: list[RankPlan],
        model_path: str,
        served_name: str,
        embedding_path: str | None,
        embedding_name: str | None,
        log: Callable[[str], None] = lambda _m: None,
    ):
        self.settings = settings
        self.plans = plans
        self.models = (model_path, served_name, embedding_path, embedding_name)
        self.log = log
        self._ranks: list[_Rank] = []
        self._started_at = 0.0

    @property
    def data_parallel_size(self) -> int:
        return len(self.plans)

    @property
    def rank_peak_memory_mb(self) -> list[float]:
        return [r.peak_memory_mb for r in self._ranks]

    @property
    def load_seconds(self) -> float:
        """Model loading, which the ranks do side by side: the slowest rank's, counted from the ranks'
        start (their processes' start and vLLM's import, wherever it happens, then the engine's build)."""
        return max(((r.startup_seconds or 0.0) + r.load_seconds for r in self._ranks), default=0.0)

    def _start(self) -> None:
        if self._ranks:
            return
        context = rank_context(self.settings.rank_start_method)
        self._started_at = time.monotonic()
        self.log("starting " + str(len(self.plans)) + " engine ranks: " + "; ".join(p.describe() for p in self.plans))
        for plan in self.plans:
            ours, theirs = context.Pipe(duplex=True)
            process = context.Process(
                target=rank_main,
                args=(plan, self.settings, self.models, theirs, os.getpid()),
                name=f"batch-pipeline-rank-{plan.rank}",
            )
            try:
                process.start()  # the first start waits for the ranks' server to import vLLM
            except BaseException:  # e.g. Ctrl-C meanwhile: the ranks started so far are stopped
                ours.close()
                theirs.close()
                self.close(stop=True)
                raise
            theirs.close()  # only the rank holds its end: its death reads as end-of-file here
            self._ranks.append(_Rank(plan, process, ours))

    def stream(self, batch_id: str, requests: Iterable[contract.BatchRequest], created: int,
               expected: int | None = None) -> Iterator[Answer]:
        """Answer a stream of mixed requests over every rank, each exactly once, as they finish.
        Answers carry the rank that computed them. With `expected` (how many requests the stream
        holds), no rank holds more than an even share of the work left (see _Feeder)."""
        self._start()
        feeder = _Feeder(iter(requests), expected, len(self._ranks))
        for rank in self._ranks:
            rank.conn.send(("batch", batch_id, created))
            rank.in_batch = True
            rank.outstanding = 0
            rank.wants.clear()
        finished = False
        try:
            while any(r.in_batch for r in self._ranks):
                # Every rank is watched, also one done with its share: a rank lost is a failure
                # (the run's next batches need it), however little work it had left.
                ranks = list(self._ranks)
                ready = wait([r.conn for r in ranks] + [r.process.sentinel for r in ranks], timeout=5.0)
                for rank in ranks:
                    if rank.conn not in ready and rank.process.sentinel not in ready:
                        continue
                    for message in self._receive(rank):
                        if rank.startup_seconds is None:
                            rank.startup_seconds = time.monotonic() - self._started_at
                        kind = message[0]
                        if kind == "answer":
                            rank.outstanding -= 1
                            yield replace(message[1], rank=rank.plan.rank)
                        elif kind == "want":
                            rank.wants.append(message[1])
                        elif kind == "log":
                            rank.load_seconds = message[2]
                            self.log(f"rank {rank.plan.rank}: {message[1]}")
                        elif kind == "batch_done":
                            _, rank.load_seconds, rank.peak_memory_mb = message
                            rank.in_batch = False
                        elif kind == "error":
                            raise RankFailed(f"engine {rank.plan.describe()} failed:\n{message[1]}")
                feeder.serve(self._ranks)
            finished = True
        except RankFailed as e:
            self.log(str(e))  # the step's failure says it too, but only at debug level before a retry
            raise
        finally:
            if not finished:  # failed, or interrupted (cancellation): no rank is left running
                self.close(stop=True)

    def _receive(self, rank: _Rank) -> Iterator[tuple[Any, ...]]:
        """Every message the rank has sent so far; RankFailed once it is gone and nothing is left."""
        while True:
            try:
                if not rank.conn.poll():
                    break
                yield rank.conn.recv()
            except (EOFError, OSError):
                break
        if not rank.process.is_alive():
            rank.process.join(timeout=1.0)
            raise RankFailed(
                f"engine {rank.plan.describe()} {rank.exit_description()} (pid {rank.process.pid}) before "
                "finishing its share of the batch; the answers already received are checkpointed and the "
                "step's retry resumes from them"
            )

    def close(self, stop: bool = False) -> None:
        """Stop every rank: ask them to close (stop=False) or signal them (stop=True: failure or
        cancellation), then kill whatever is left after STOP_SECONDS."""
        ranks, self._ranks = self._ranks, []
        for rank in ranks:
            if not rank.process.is_alive():
                continue
            try:
                if stop:
                    rank.process.terminate()
                else:
                    rank.conn.send(("close",))
            except (OSError, ValueError):
                rank.process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for rank in ranks:
            rank.process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if rank.process.is_alive():
                self.log(f"rank {rank.plan.rank} did not stop within {STOP_SECONDS:.0f}s; killing it")
                rank.process.kill()
                rank.process.join(timeout=10.0)
            rank.conn.close()


def rank_context(method: str = "forkserver") -> multiprocessing.context.BaseContext:
    """How rank processes start (RANK_START_METHOD): forked from the ranks' server (see RANK_PRELOAD),
    or spawned, each a new interpreter that imports vLLM itself (also where forkserver is not offered)."""
    if method != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


# -- the rank process --------------------------------------------------------------------------


def _set_title(title: str) -> None:
    """What `ps` and `top` show for the rank (vLLM names its own processes VLLM::... the same way)."""
    try:
        import setproctitle  # a dependency of vLLM

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def _die_with_parent(run_pid: int) -> None:
    """SIGTERM this process when the run process dies, even by SIGKILL (Linux).

    PR_SET_PDEATHSIG covers a spawned rank, whose parent is the run process. A forked rank's parent
    is the ranks' server, which outlives the run process while any rank lives (each holds the end of
    the pipe it watches), so the rank also watches the run process itself, through a pidfd."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    try:
        pidfd = os.pidfd_open(run_pid)
    except (ProcessLookupError, PermissionError):  # the run process died already
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):  # not Linux 5.3+: PR_SET_PDEATHSIG and the pipe's end remain
        try:
            os.kill(run_pid, 0)
        except (ProcessLookupError, PermissionError):  # the run process died before the prctl above
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the run process has ended
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rank-run-watch", daemon=True).start()


def _refuse_a_forked_cuda_context() -> None:
    """A rank forked after its server initialised CUDA would fail at its first CUDA call, far from the
    cause: say it at once. (vLLM's import does not initialise CUDA; a plugin or a changed build might.)"""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("the ranks' fork server initialised CUDA while importing vLLM, and a forked process "
                           "cannot use it: set RANK_START_METHOD=spawn")


class _Inbox:
    """What the run process sent, read by a thread so the run process never blocks on a send."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.messages: queue.Queue[tuple[Any, ...]] = queue.Queue()
        threading.Thread(target=self._read, name="rank-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                self.messages.put(self.conn.recv())
            except (EOFError, OSError):
                self.messages.put(("gone",))
                return


class _Outbox:
    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)


def _requests(inbox: _Inbox, outbox: _Outbox) -> Iterator[Any]:
    """One batch's requests as the rank's engine takes them, asking the run process for more ahead
    of need; NOTHING_YET while an answer to "want" is on its way."""
    from batch_pipeline.engine.generation import NOTHING_YET

    buffered: deque[contract.BatchRequest] = deque()
    asked = 0
    ended = False
    first = True  # until the first request is taken, ask for one: the engine loads after it, and
    # the other ranks, loading too, should not find a small batch taken whole
    while True:
        while not ended and len(buffered) + asked * WANT < (1 if first else PREFETCH):
            outbox.send(("want", 1 if first else WANT))
            asked += 1
        if buffered:
            first = False
            yield buffered.popleft()
            continue
        if ended:
            while asked:  # the replies to wants still on their way: all "end" once one is
                if inbox.messages.get()[0] not in ("end", "requests"):
                    raise SystemExit(0)
                asked -= 1
            return
        try:
            message = inbox.messages.get(timeout=0.01)
        except queue.Empty:
            yield NOTHING_YET
            continue
        if message[0] == "requests":
            buffered.extend(message[1])
            asked -= 1
        elif message[0] == "end":
            ended = True
            asked -= 1
        else:  # "close" or "gone" in the middle of a batch: the run process stopped
            raise SystemExit(0)


def rank_main(plan: RankPlan, settings: EngineSettings, models: tuple[Any, ...], conn: Connection, parent_pid: int) -> None:
    """Entry point of a rank process (see rank_context): place it, then answer batches until told to close."""
    os.environ.update(plan.env)
    if plan.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpus)
    # Titled once placed: a forked rank starts with its server's cores, and whoever finds it by its
    # title (ps, a test) sees its own.
    _set_title(f"{RANK_TITLE}{plan.rank}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds into the engine shutdown below
    _die_with_parent(parent_pid)
    forked = "batch_pipeline.engine.rank_server" in sys.modules  # from the ranks' server
    if forked:
        from batch_pipeline.engine.rank_server import restore_environment

        restore_environment()  # after the placement: torch's threads fit the cores the rank has
    from batch_pipeline.engine.local import Engines
    from batch_pipeline.base.runtime import peak_memory_mb
    from batch_pipeline.base.runtime import exit_without_teardown

    outbox = _Outbox(conn)
    inbox = _Inbox(conn)
    engines: Engines | None = None

    def log(text: str) -> None:
        outbox.send(("log", text, engines.load_seconds if engines else 0.0))

    engines = Engines(settings, *models, log=log, queue_factor=RANK_QUEUE[0], queue_floor=RANK_QUEUE[1])
    code = 0
    try:
        if forked:
            _refuse_a_forked_cuda_context()
        while True:
            message = inbox.messages.get()
            if message[0] != "batch":
                break  # "close", or the run process is gone
            _, batch_id, created = message
            for answer in engines.stream(batch_id, _requests(inbox, outbox), created):
                outbox.send(("answer", answer))
            outbox.send(("batch_done", engines.load_seconds, peak_memory_mb()))
    except KeyboardInterrupt:  # Ctrl-C in a terminal reaches the whole process group
        code = 130
    except SystemExit as e:  # SIGTERM from the run process (stop), or its end mid-batch
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported to the run process, which fails the step
        code = 1
        try:
            outbox.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        engines.close()
    exit_without_teardown(code)

"""The inference step of a batch: answer every valid request not answered yet, checkpointing as it goes."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from batch_pipeline import contract
from batch_pipeline.contract.prompts import SharesPrefix
from batch_pipeline.io import images, storage
from batch_pipeline.io.checkpoints import Checkpoint, LineSet, answered_lines, answers_folder, checkpoint_key, record_line
from batch_pipeline.engine.local import Engines
from batch_pipeline.engine.ranks import RankedEngines
from batch_pipeline.engine.remote import RemoteEngines
from batch_pipeline.io.shards import Shard, merge_if_complete
from batch_pipeline.engine.gpu import GpuSampler
from batch_pipeline.io.locations import BatchLocation
from batch_pipeline.base.errors import CancelRequested
from batch_pipeline.base.runtime import peak_memory_mb
from batch_pipeline.steps.ordering import Plan, PlanPart, chat_template_renderer, make_joint_plan
from batch_pipeline.base.progress import Log, Progress, quiet
from batch_pipeline.config.settings import DEFAULT_ORDER
from batch_pipeline.steps.validation import request_from_record



def _requests_of(loc: BatchLocation, positions: range | None) -> Iterator[tuple[int, bytes]]:
    """(input line, raw record) of the valid requests, in input order; with `positions`, only those
    at these ordinal positions (a shard)."""
    for line, _, raw in _records_of(loc, positions):
        yield line, raw


def _records_of(loc: BatchLocation, positions: range | None) -> Iterator[tuple[int, int, bytes]]:
    """(input line, byte offset, raw record) of the valid requests, in input order; with
    `positions`, only those at these ordinal positions (a shard). The line number is read off the
    record's start (`{"line":N,...}`, as ingest writes it), so skipping other shards' requests
    parses nothing."""
    with storage.open_read(loc.work("requests.jsonl")) as f:
        position, offset = -1, 0
        for raw in f:
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            position += 1
            if positions is not None and position not in positions:
                continue
            yield record_line(raw), at, raw


def plan_requests(loc: BatchLocation, positions: range | None, done: LineSet, count: int, model_path: str,
                  log: Log = quiet, label: str = "") -> Plan:
    """ORDER=planned: the `count` requests not answered yet, keyed and put in plan order
    (steps/ordering.py), before any engine is built. Keys come from the served model's chat template."""
    return _plan([(loc, positions, done, count)], model_path, log, label or loc.name)


def _plan(parts: list[tuple[BatchLocation, range | None, LineSet, int]], model_path: str, log: Log, label: str) -> Plan:
    """One plan over the requests left in each (batch, shard positions, lines done, count left)."""
    started = time.perf_counter()
    render, keyed_on = chat_template_renderer(model_path) if model_path else (None, "request text")
    planned = []
    for loc, positions, done, count in parts:
        local = storage.local_path(loc.work("requests.jsonl"))
        records = ((offset, raw) for line, offset, raw in _records_of(loc, positions) if line not in done)
        planned.append(PlanPart(records, count, str(local) if local is not None else None))
    plan = make_joint_plan(planned, render, keyed_on)
    plan.seconds = time.perf_counter() - started  # the tokenizer's load included
    log(f"{label}: planned the order of {len(plan)} requests in {plan.seconds:.2f}s "
        f"({plan.describe_groups()}; keyed on {plan.keyed_on})")
    return plan


@dataclasses.dataclass
class _Work:
    """One batch's (or shard's) part of an answering attempt: what is left, and what was done."""

    loc: BatchLocation
    batch_id: str
    key: str
    done: LineSet
    record: str  # its inference record: _work/inference.json, or the shard's
    positions: range | None
    total: int
    answered: int
    label: str
    info: dict[str, Any]
    checkpoint: Checkpoint | None = None
    per_rank: list[int] = dataclasses.field(default_factory=list)
    tokens: int = 0  # prompt and output tokens computed in this attempt: its share of a joint answering
    images: int = 0  # images in the prompts of the lines answered (not failed) in this attempt

    @property
    def left(self) -> int:
        return self.total - self.answered

    def requests(self) -> Iterator[contract.BatchRequest]:
        """Its requests not answered yet, in input order."""
        return (request_from_record(json.loads(raw), self.batch_id)
                for line, raw in _requests_of(self.loc, self.positions) if line not in self.done)


def _begin(loc: BatchLocation, identity: dict[str, Any], shard: Shard, deadline: float | None,
           log: Log) -> _Work | dict[str, Any]:
    """A batch's work left, with its record marked in progress; or, when there is nothing to
    answer (all answered already, or its deadline passed), its final record."""
    validation = storage.read_json(loc.work("validation.json"))
    key = checkpoint_key(validation["sha256"], identity)
    done = answered_lines(loc, key)
    record = loc.work(shard.record_name())
    positions = None if shard.whole else shard.positions(validation["valid"])
    total = validation["valid"] if positions is None else len(positions)
    answered = done.count if positions is None else sum(1 for line, _ in _requests_of(loc, positions) if line in done)
    label = loc.name if shard.whole else f"{loc.name} shard {shard}"
    previous = storage.read_json(record) if storage.exists(record) else None
    if answered == total and previous and previous.get("checkpoint_key") == key and previous.get("finished_at"):
        log(f"{label}: all {answered} requests already answered; nothing to compute")
        _merge_shards(loc, key, shard, log)
        return {**previous, "computed_requests": 0}
    info: dict[str, Any] = {
        "checkpoint_key": key,
        "engine": identity,
        "resumed_requests": answered,
        "in_progress_at": int(time.time()),
        "finished_at": None,
    }
    if not shard.whole:
        info["shard"] = str(shard)
    if deadline is not None:
        info["expires_at"] = int(deadline)
        if time.time() >= deadline:  # e.g. queued past its window: no model is loaded for it
            info["expired_at"] = int(time.time())
            storage.write_json(record, info)
            log(f"{label}: its deadline passed before it ran; {total - answered} of {total} requests expire")
            return {**info, "computed_requests": 0}
    storage.write_json(record, info)
    if answered:
        log(f"{label}: {answered} of {total} requests already answered; resuming")
    return _Work(loc, validation["batch_id"], key, done, record, positions, total, answered, label, info)


def answered_in_full(loc: BatchLocation, identity: dict[str, Any], shard: Shard = Shard()) -> bool:
    """Whether the batch's (or shard's) record says this engine answered all of it: a run
    interrupted while answering several batches together cancels only the others."""
    record = loc.work(shard.record_name())
    if not storage.exists(record):
        return False
    info = storage.read_json(record)
    key = checkpoint_key(storage.read_json(loc.work("validation.json"))["sha256"], identity)
    return info.get("checkpoint_key") == key and bool(info.get("finished_at"))


def infer_batch(
    loc: BatchLocation,
    engines: Engines | RankedEngines,
    identity: dict[str, Any],
    checkpoint_answers: int,
    checkpoint_seconds: float,
    log: Log = quiet,
    shard: Shard = Shard(),
    deadline: float | None = None,
    order: str = DEFAULT_ORDER,
    cancelled: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Answer the requests in _work/requests.jsonl (of `shard` only, when given) that no earlier
    attempt answered; returns what the shard's record (_work/inference.json for a whole batch)
    holds: engine identity, timings, checkpoint parts, peak memory.

    When every request is answered already, no engine is built and the record is left as the
    attempt that did the work wrote it, so its figures survive a run that had nothing to do. The
    shard that completes a sharded batch merges the shards' records into inference.json.

    With a `deadline` (Unix time; the Batch API's completion window), answering stops once it has
    passed: the record gets `expired_at` instead of `finished_at`, and the results step reports the
    requests still unanswered as batch_expired (their answers so far are kept, in the checkpoints).

    `cancelled`, asked after every answer: once it says True, answering stops (the engine drops what
    it holds, every answer so far is checkpointed) and CancelRequested is raised, as a Ctrl-C would be
    (defs/run_watch.py: a run Dagster marks cancelling whose interrupt never came).

    `order`: "input" feeds the requests in file order; "planned" (ORDER's default) in the order
    steps/ordering.py plans (shared prefixes together, long decodes first). Which one changes only
    the speed: answers are checkpointed by line and the results written in input order.
    """
    return infer_batches([loc], engines, identity, checkpoint_answers, checkpoint_seconds, log, shard, deadline, order,
                         cancelled)[0]


def infer_batches(
    locs: list[BatchLocation],
    engines: Engines | RankedEngines,
    identity: dict[str, Any],
    checkpoint_answers: int,
    checkpoint_seconds: float,
    log: Log = quiet,
    shard: Shard = Shard(),
    deadline: float | None = None,
    order: str = DEFAULT_ORDER,
    cancelled: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    """infer_batch for each of `locs` (a run's batches of one model), their records in that order.

    ORDER=planned plans and answers them together, as one stream: a date's files often share
    system prompts or documents, which are then computed once for all of them, and the engine is
    not drained at the end of each file. Each batch keeps its own checkpoints and record, and is
    recorded finished as soon as its last answer is in. The answering time (and the model load and
    planning) of a joint stream is shared out among its batches in proportion to the tokens each
    computed, so that the batches' seconds add up to the wall time and each one's throughput is the
    stream's; their records name the batches they were answered with (`answered_with`).

    ORDER=input answers them one after another, each in file order, as before plans existed.
    """
    finals: list[dict[str, Any] | None] = []
    works: list[_Work] = []
    for loc in locs:
        begun = _begin(loc, identity, shard, deadline, log)
        finals.append(begun if isinstance(begun, dict) else None)
        if isinstance(begun, _Work):
            works.append(begun)
    ids = [w.batch_id for w in works]
    together = order == "planned" and len(works) > 1 and len(set(ids)) == len(ids)
    how = _How(identity, checkpoint_answers, checkpoint_seconds, log, shard, deadline, order, cancelled)
    for group in ([works] if together else [[w] for w in works]) if works else []:
        _Answering(group, engines, how).run()
    infos = iter(w.info for w in works)
    return [final if final is not None else next(infos) for final in finals]


@dataclasses.dataclass(frozen=True)
class _How:
    """How an answering goes, the same for every stream of a run (infer_batches' arguments)."""

    identity: dict[str, Any]
    checkpoint_answers: int
    checkpoint_seconds: float
    log: Log
    shard: Shard
    deadline: float | None
    order: str
    cancelled: Callable[[], bool] | None


class _Answering:
    """What is left of `works` answered in one engine stream, each one's record written: the source
    (`_source`: planned or in input order), the stream (`run`, each answer taken by `_take`), and the
    figures shared out among the batches at the end (`_close`)."""

    def __init__(self, works: list[_Work], engines: Engines | RankedEngines | RemoteEngines, how: _How) -> None:
        self.works, self.engines, self.how = works, engines, how
        self.total, self.answered = sum(w.total for w in works), sum(w.answered for w in works)
        self.label = works[0].label if len(works) == 1 else f"{len(works)} batches"
        self.by_id = {w.batch_id: w for w in works}
        self.plan: Plan | None = None
        self.pictures: dict[tuple[str, int], int] = {}  # (batch, line) -> its images, until it is answered
        self.ranks = engines.data_parallel_size
        for w in works:
            w.per_rank = [0] * self.ranks
        self.load_before = engines.load_seconds
        self.clock = getattr(engines, "clock", None)  # None with ranks: each rank's engine is in its own process
        self.clock_before = dataclasses.replace(self.clock) if self.clock is not None else None
        self.expired = False
        self.unfinished = len(works)
        self.started, self.started_at = 0.0, 0.0

    def _source(self) -> Iterator[Any]:
        """The requests left, in plan order (ORDER=planned) or input order, each one's images noted."""
        left = self.total - self.answered
        planned = self.how.order == "planned" and left > 1
        # A warm engine takes a stream no longer than its window all at once: then the order is its own
        # scheduler's (and its priority's prefix rank, engine/remote.py), and a plan (a tokenizer load,
        # seconds for a small batch) would change nothing.
        if planned and left <= self.engines.takes_at_once:
            self.how.log(f"{self.label}: {left} requests, all in flight at once on the warm engine: not planned")
            planned = False
        if planned:
            works = self.works
            self.plan = _plan([(w.loc, w.positions, w.done, w.left) for w in works],
                              str(self.how.identity.get("model_path") or ""), self.how.log, self.label)
            source: Iterator[Any] = self.plan.stream(
                lambda raw, part: request_from_record(json.loads(raw), works[part].batch_id))
        else:
            source = itertools.chain.from_iterable(w.requests() for w in self.works)
        return (_NotingPlannedImages if isinstance(source, SharesPrefix) else _NotingImages)(source, self.pictures)

    def run(self) -> None:
        source = self._source()
        self.progress = Progress(self.total, self.answered, self.how.log, self.label)  # after the plan, as its rate
        self.started, self.started_at = time.monotonic(), time.time()
        with contextlib.ExitStack() as stack:
            self.gpu = stack.enter_context(GpuSampler())
            for w in self.works:
                w.checkpoint = stack.enter_context(
                    Checkpoint(answers_folder(w.loc, w.key), self.how.checkpoint_answers, self.how.checkpoint_seconds))
            if self.plan is not None:
                stack.enter_context(contextlib.closing(self.plan))
            stream = self.engines.stream(self.works[0].batch_id, source, created=int(time.time()),
                                         expected=self.total - self.answered)
            for answer in stream:
                self._take(answer)
                if self._stop(stream):
                    break
        self._close()

    def _take(self, answer: Any) -> None:
        """One answer: checkpointed, counted, and its batch recorded finished when it is the last."""
        w = self.by_id[answer.batch_id] if len(self.works) > 1 else self.works[0]
        if not w.done.add(answer.line):
            raise RuntimeError(f"{w.label}: line {answer.line} answered twice")
        assert w.checkpoint is not None
        w.checkpoint.add(answer)
        w.per_rank[answer.rank] += 1
        w.tokens += answer.prompt_tokens - answer.cached_tokens + answer.completion_tokens
        w.answered += 1
        self.answered += 1
        self.progress.excluded = self.engines.load_seconds - self.load_before
        shown = self.pictures.pop((answer.batch_id or w.batch_id, answer.line), 0) if self.pictures else 0
        shown = shown if answer.kind == "output" else 0  # a line whose image failed showed none
        w.images += shown
        self.progress.advance(answer.completion_tokens, shown)
        if w.answered == w.total and len(self.works) > 1:
            # Its answers are all in: written and recorded now, so that an interrupt of the
            # others does not cancel it. Its figures are final once the stream is done.
            w.checkpoint.flush()
            self.unfinished -= 1
            _record(w, "finished_at", self.how.order, self.plan, self.ranks, w.checkpoint, self.engines, self.gpu, {
                "model_load_seconds": 0.0, "inference_seconds": round(time.monotonic() - self.started, 3),
                "answered_with": [o.loc.name for o in self.works if o is not w]})
            self.how.log(f"{w.label}: all {w.total} requests answered "
                         f"({self.unfinished} of {len(self.works)} batches still answering)")

    def _stop(self, stream: Any) -> bool:
        """After an answer: True when the deadline has passed (the stream closed, the rest expire);
        CancelRequested when the run is cancelled (the checkpoints keep every answer)."""
        if self.answered >= self.total:
            return False
        if self.how.deadline is not None and time.time() >= self.how.deadline:
            self.expired = True
            stream.close()  # the engine drops the requests still running
            return True
        if self.how.cancelled is not None and self.how.cancelled():
            stream.close()  # as above; the checkpoints keep every answer when the stack unwinds
            raise CancelRequested(f"{self.label}: cancelled after {self.answered} of {self.total} requests")
        return False

    def _close(self) -> None:
        """Every batch's record: its share (by tokens) of the load, answering and planning time."""
        log, label = self.how.log, self.label
        if self.expired:
            log(f"{label}: its deadline passed; {self.answered} of {self.total} requests answered, "
                f"{self.total - self.answered} expire")
        else:
            for w in self.works:
                if w.answered != w.total:
                    raise RuntimeError(f"{w.label}: {w.total} valid requests but {w.answered} answers")
        load_seconds = self.engines.load_seconds - self.load_before
        idle, image_wait = self._engine_shares()
        inference_seconds = max(time.monotonic() - self.started - load_seconds, 0.0)
        finished_at = time.time()
        weights = _shares([w.tokens for w in self.works])
        served = self.engines.figures  # a warm engine's own figures over this stream (engine/remote.py); else None
        if served is not None:
            # A shared engine: each batch's engine time is the answering time x its share of the tokens the
            # engine computed meanwhile (for every run using it), not the whole wall time.
            weights = [served.share_of(w.tokens) for w in self.works]
            if served.busy_share is not None:
                log(f"{label}: the warm engine was busy {100 * served.busy_share:.1f}% of the answering time; this "
                    f"run's share of the tokens it computed meanwhile: {100 * sum(weights):.1f}%")
        plan, works = self.plan, self.works
        for w, share in zip(works, weights):
            assert w.checkpoint is not None
            _record(w, "expired_at" if self.expired and w.answered < w.total else "finished_at", self.how.order, plan,
                    self.ranks, w.checkpoint, self.engines, self.gpu, {
                        "model_load_seconds": round(load_seconds * share, 3),
                        "inference_seconds": round(inference_seconds * share, 3),
                        # Wall-clock span of the answering (after the model load), for merging shards
                        # that ran side by side on other servers (shards.busy_seconds).
                        "inference_started_at": round(self.started_at + load_seconds, 3),
                        "inference_finished_at": round(finished_at, 3),
                        "planning_seconds": round(plan.seconds * share, 3) if plan is not None else 0.0,
                        **({"engine_idle_share": idle} if idle is not None else {}),
                        **({"engine_busy_share": served.busy_share, "engine_token_share": round(share, 4),
                            "engine_url": served.url} if served is not None else {}),
                        **({"images": w.images} if w.images else {}),
                        **({"image_wait_share": image_wait} if image_wait is not None else {}),
                        **({"answered_with": [o.loc.name for o in works if o is not w]} if len(works) > 1 else {}),
                    })
            _merge_shards(w.loc, w.key, self.how.shard, log)

    def _engine_shares(self) -> tuple[float | None, float | None]:
        """The in-process engine's idle share and its wait on image preparation over this stream
        (logged; None where there is no engine clock: ranks, a warm engine)."""
        clock, before = self.clock, self.clock_before
        idle = clock.idle_share(before) if clock is not None else None
        if idle is not None:
            self.how.log(f"{self.label}: the engine stepped {100 * (1 - idle):.1f}% of the answering time (idle "
                         f"{100 * idle:.1f}%: waiting on this process to prepare requests and take answers)")
        image_wait = clock.image_wait_share(before) if clock is not None and self.progress.images else None
        if image_wait is not None:
            self.how.log(f"{self.label}: {self.progress.images} images; the engine waited on image preparation "
                         f"{100 * image_wait:.1f}% of the answering time")
        return idle, image_wait


class _NotingImages:
    """The requests, each one's image count noted in `pictures` (for progress and the record). A
    planned source's `shared` (SharesPrefix) is passed on, for the data-parallel feeder."""

    def __init__(self, source: Iterator[Any], pictures: dict[tuple[str, int], int]):
        self._source, self._pictures = source, pictures

    def __iter__(self) -> "_NotingImages":
        return self

    def __next__(self) -> Any:
        req = next(self._source)
        if req.url in (contract.CHAT_URL, contract.RESPONSES_URL):
            count = images.count_images(req.url, req.body)
            if count:
                self._pictures[(req.batch_id, req.line)] = count
        return req



class _NotingPlannedImages(_NotingImages):
    """_NotingImages of a planned stream: a SharesPrefix too."""

    @property
    def shared(self) -> int:
        return self._source.shared


def _shares(tokens: list[int]) -> list[float]:
    """Each batch's share of a joint answering, by the tokens it computed (evenly when none did)."""
    whole = sum(tokens)
    return [t / whole for t in tokens] if whole else [1 / len(tokens)] * len(tokens)


def _record(w: _Work, ended: str, order: str, plan: Plan | None, ranks: int, checkpoint: Checkpoint,
            engines: Engines | RankedEngines, gpu: GpuSampler, timings: dict[str, Any]) -> None:
    w.info.pop("finished_at", None)
    w.info.update(
        {ended: int(time.time())},
        computed_requests=w.answered - w.info["resumed_requests"],
        **timings,
        ordering=order,
        data_parallel_size=ranks,
        # The GPUs the engines were given: TENSOR_PARALLEL_SIZE x ranks (cost counts at most these, not
        # every GPU the process can see).
        engine_gpus=engines.settings.tensor_parallel_size * ranks,
        requests_per_rank=w.per_rank,
        checkpoint_parts=checkpoint.parts,
        checkpoint_write_seconds=round(checkpoint.write_seconds, 3),
        # With ranks, their processes hold the engines: the run process's peak plus each rank's.
        peak_memory_mb=round(peak_memory_mb() + sum(engines.rank_peak_memory_mb), 1),
        gpu=gpu.figures(),
    )
    if ended != "finished_at":
        w.info["finished_at"] = None
    storage.write_json(w.record, w.info)


def _merge_shards(loc: BatchLocation, key: str, shard: Shard, log: Log) -> None:
    if shard.whole:
        return
    finished, merged = merge_if_complete(loc, key, shard.count)
    if merged is None:
        log(f"{loc.name}: shard {shard} done; {finished} of {shard.count} shards finished, the last one writes the results")
    else:
        log(f"{loc.name}: all {shard.count} shards finished")

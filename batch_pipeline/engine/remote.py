"""A warm engine: vLLM's own OpenAI-compatible server answers a run's requests over HTTP.

With ENGINE_URL set, a run imports no vLLM and loads no model: `RemoteEngines` sends each request of
the default model (chat, completions, Responses; LoRA adapters served beside it; images fetched and
checked here as in-process, sent as data: URLs) to the server and
writes the same result lines the in-process engine writes (contract/lines.py's envelope, the same
deterministic ids, the same `context_length_exceeded` error line for a prompt over the limit, usage
with cached tokens). The pooling models' lines (embeddings, score, rerank) go to their own warm
engine when EMBEDDING_ENGINE_URL / SCORE_ENGINE_URL name one (a server started with --runner
pooling). Requests of a model with no warm engine still run in-process, built only if such a line comes.

Feeding. The run's requests go in its planned order (steps/ordering.py) through a bounded window of
requests in flight (ENGINE_WINDOW): vLLM's own waiting queue is unbounded and first-come, so the
window is what keeps the plan's order, and keeps a prefix group's members close enough together that
its KV blocks are still cached when the later ones arrive. Each request carries a vLLM priority
(`vllm_priority`: the run's batch priority first, then the minute it was sent, then its prompt
prefix's rank, so that concurrent runs' requests for one prefix meet in the prefix cache) and the
line's deterministic request id.

Yielding. vLLM's priority orders only its waiting queue: a request already running is not put back
for a more urgent one, and on a server whose running batch holds everything sent (a CPU, or a large
`max_num_seqs`), an urgent batch's requests share every decode step with the bulk's. So a run also
yields by itself: while `outranked()` names a run of higher priority answering on the same engine
(defs/run_watch.py watches Dagster for one), it pulls back what it has in flight beyond the
YIELD_WINDOW oldest (their connections closed: the server aborts them) and keeps at most YIELD_WINDOW
requests at the server; when that run is done, the held requests go again and the window is its own.

Faults. A refused connection, a dropped one, 408, 429 and 5xx are waited out: the request is sent
again after a back-off, and the window halves (then grows back by one per answer: AIMD). A server
that stays away ENGINE_WAIT_SECONDS fails the run naming its URL; the next run resumes from the
checkpoints, and no line is written twice (one answer per line, taken once). Closing the stream (a
cancel, an expiry, an interrupt) closes the connections in flight, and the server aborts those
requests (its routes stop generating when their client goes away).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from batch_pipeline.base import ids
from batch_pipeline import contract
from batch_pipeline.contract import lines
from batch_pipeline.contract.lines import Answer
from batch_pipeline.contract.prompts import RANK_SPAN, prefix_rank
from batch_pipeline.io import images
from batch_pipeline.config.model_versions import VERSION_SEP, versioned_name
from batch_pipeline.config.settings import ConfigError, EngineSettings

# The window when neither ENGINE_WINDOW nor BATCH_SIZE says: vLLM's CPU default of sequences decoded
# together is 256, a GPU's 1024; 64 keeps 2 CPU cores' engine busy without queueing the plan away.
DEFAULT_WINDOW = 64
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0  # seconds between tries of a request the server did not take
CONNECT_SECONDS = 10.0
ANSWER_SECONDS = 1800.0  # one request's answer (a long decode on a loaded CPU server takes minutes)
SHORT_SECONDS = 15.0  # the server's model list and /metrics: a server silent this long is not answering
# A stream that gets no answer for this long asks each server holding its requests for /health: a
# server that stays silent there for ENGINE_WAIT_SECONDS is out (hung, or its host gone without a
# reset), and the run stops rather than wait out ANSWER_SECONDS on its open connections.
STALL_CHECK_SECONDS = 30.0
# Requests a run keeps in flight while a run of higher priority answers on its engine: enough that
# it still moves, few enough that the urgent run's decode steps are nearly its own.
YIELD_WINDOW = 2
YIELD_CHECK_SECONDS = 0.25  # how often a run looks whether a more urgent one has come or gone
LINE_ERROR_TRIES = 3  # a 500 with an error body, this many times for one line: that line's error
GENERATION_URLS = (contract.CHAT_URL, contract.COMPLETIONS_URL, contract.RESPONSES_URL)
POOLING_URLS = (contract.EMBEDDINGS_URL, contract.SCORE_URL, contract.RERANK_URL)


class EngineUnavailable(RuntimeError):
    """The warm engine stopped answering for longer than ENGINE_WAIT_SECONDS."""


def base_url(url: str) -> str:
    """ENGINE_URL without a trailing `/v1` or slash: the server's root (request paths add /v1/...)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def window_size(settings: EngineSettings) -> int:
    """ENGINE_WINDOW, else twice BATCH_SIZE (the engine decodes a batch while the next is queued), else 64."""
    if settings.engine_window:
        return settings.engine_window
    return 2 * settings.batch_size if settings.batch_size else DEFAULT_WINDOW


def start_window(settings: EngineSettings) -> int:
    """ENGINE_START_WINDOW (never more than the window): what a run sends at first. The window then
    grows by one per answer, so it doubles with each round of answers (TCP's slow start). The engine
    never cuts short a step it has begun, and a whole window of prompts at once fills its steps with
    prefill (up to 2,048 tokens a step on a CPU server): seconds each on a CPU core, which an urgent
    batch arriving then waits through."""
    return min(settings.engine_start_window, window_size(settings))


def warm_routes(settings: EngineSettings, served_name: str) -> dict[str, str]:
    """{served model name: its warm engine's URL}: the default model and its LoRA adapters on
    ENGINE_URL, each MODELS_FILE entry (or version) with a `url` on that. Empty: no warm engine."""
    routes: dict[str, str] = {}
    if settings.engine_url:
        routes.update({name: base_url(settings.engine_url) for name in (served_name, *settings.lora_adapters())})
    for name, entry in settings.model_registry().items():
        if entry.engine_url:
            routes[name] = base_url(entry.engine_url)
    return routes


def pooling_routes(settings: EngineSettings, embedding_name: str | None) -> dict[str, str]:
    """{served name: its warm engine's URL} of the pooling models: the embedding model on
    EMBEDDING_ENGINE_URL (its embeddings, and score/rerank when no SCORE_MODEL_PATH), the scoring
    model on SCORE_ENGINE_URL. Empty: they are answered in the run's own process."""
    routes: dict[str, str] = {}
    if settings.embedding_engine_url and embedding_name:
        routes[embedding_name] = base_url(settings.embedding_engine_url)
    score = settings.score_model()
    if score is not None and settings.score_engine_url:
        routes[score[1]] = base_url(settings.score_engine_url)
    return routes


# A request's vLLM priority holds three keys, most significant first (see vllm_priority).
EPOCH_SECONDS = 60  # requests sent within one such minute are ordered by prefix, across runs
EPOCH_SPAN = 1 << 28  # epochs are counted modulo this (60 s epochs: it wraps every ~510 years)
BATCH_SCALE = EPOCH_SPAN * RANK_SPAN  # 2^52: a batch priority of +-1000 keeps the value within int64


def vllm_priority(batch_priority: int, rank: int = 0, sent: float | None = None) -> int:
    """A request's priority on vLLM's scale, where lower runs sooner (its waiting queue is a heap on
    (priority, arrival)), from three keys, most significant first:

    1. the batch's priority, negated (ours is higher sooner: Batch API metadata.priority,
       SCHEDULE_RUN_PRIORITY, SENSOR_RUN_PRIORITY): an urgent batch's requests overtake the rest;
    2. the minute it was sent (`sent`, EPOCH_SECONDS): an earlier minute's requests go first, so no
       run's requests wait behind other runs' for longer than about that;
    3. its prompt prefix's rank (contract/prompts.py `prefix_rank`, the same in every run): within a
       minute, the users of one prefix (a system prompt, a document) are admitted together whichever
       runs sent them, so the engine computes that prefix once while it is cached. A date's files
       sent as concurrent file runs meet in the prefix cache as one run's plan would have them.

    Without `sent` (a rank of 0): the batch's key alone, as a whole number of BATCH_SCALE."""
    epoch = 0 if sent is None else int(sent // EPOCH_SECONDS) % EPOCH_SPAN
    return -int(batch_priority) * BATCH_SCALE + epoch * RANK_SPAN + rank


@dataclass
class Window:
    """Requests in flight: `start` at first (slow start), grown by one per answer up to the ceiling,
    halved when the server pushes back (AIMD)."""

    ceiling: int
    start: int = 0  # 0: the ceiling at once
    size: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.start = min(self.start or self.ceiling, self.ceiling)
        self.size = float(self.start)

    def now(self) -> int:
        return max(1, int(self.size))

    def restart(self) -> None:
        """Back to the start (not above where it is): after a pause, ramp up again rather than burst."""
        with self.lock:
            self.size = min(self.size, float(self.start))

    def shrink(self) -> None:
        with self.lock:
            self.size = max(1.0, self.size / 2)

    def grow(self) -> None:
        with self.lock:
            self.size = min(float(self.ceiling), self.size + 1.0)


@dataclass(frozen=True)
class Reply:
    """A server's HTTP answer: its status and body bytes."""

    status: int
    data: bytes

    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


class EngineClient:
    """The server's HTTP API: its models, and requests from many threads, each thread on a kept-alive
    connection of its own. `abort()` shuts every connection down at once, those waiting for an
    answer too, so the server sees its clients gone and aborts their requests (vLLM's routes stop
    generating when the client disconnects). The key goes in the Authorization header only; no
    message here ever includes it."""

    def __init__(self, url: str, api_key: str = "") -> None:
        self.url = base_url(url)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"ENGINE_URL={url!r} is not an http:// or https:// URL")
        self._https, self._host, self._port, self._prefix = (parts.scheme == "https", parts.hostname, parts.port,
                                                             parts.path.rstrip("/"))
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is None:  # shut down by abort(): never reopened with the connect timeout
            self._drop(conn)
            conn = None
        if conn is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = kind(self._host, self._port, timeout=CONNECT_SECONDS)
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(ANSWER_SECONDS)  # connecting is quick or never; an answer may take minutes
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        self._local.conn, self._local.used = None, False
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None, timeout: float = ANSWER_SECONDS,
                stop: threading.Event | None = None, sent: "Sent | None" = None) -> Reply:
        """One request on this thread's connection; raises OSError or http.client's errors when the
        server cannot be reached or the connection drops (the connection is then dropped too). A
        kept-alive connection the server closed while idle (vLLM's after 5 s) is no fault of the
        server: the request goes once more on a new connection. `stop` set: nothing is sent.
        `sent`: the request's connection is kept there, so that it can be pulled back (see
        "Yielding"); one pulled back raises, as a dropped connection does."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):
            conn = self._connection()
            reused = getattr(self._local, "used", False)
            if stop is not None and stop.is_set():
                raise Stopped(path)
            if sent is not None:
                sent.conn = conn
            try:
                assert conn.sock is not None
                conn.sock.settimeout(timeout)
                conn.request(method, self._prefix + path, body=data, headers={**self._headers, **(headers or {})})
                response = conn.getresponse()
                reply = Reply(response.status, response.read())
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                self._drop(conn)
                if reused and attempt == 1 and not (sent is not None and sent.pulled.is_set()):
                    continue  # the server had closed it while it sat idle
                raise
            except BaseException:
                self._drop(conn)
                raise
            self._local.used = True
            if response.will_close:
                self._drop(conn)
            return reply
        raise AssertionError("unreachable")

    def models(self) -> list[str]:
        """The model names the server serves (its base models and LoRA adapters); raises
        EngineUnavailable naming the URL when it does not answer or answers something else."""
        return [str(card["id"]) for card in self.model_cards()]

    def model_cards(self) -> list[dict[str, Any]]:
        """The server's /v1/models entries: `id` (the served name), and from vLLM `root` (the weights'
        path it loaded, or an adapter's), `parent`, `max_model_len`. Raises as models()."""
        try:
            reply = self.request("GET", "/v1/models", timeout=SHORT_SECONDS)
        except (OSError, http.client.HTTPException) as e:
            raise EngineUnavailable(f"the warm engine at {self.url} does not answer ({type(e).__name__}: {e}); "
                                    "start one with `batch-pipeline engine start` or unset ENGINE_URL") from None
        if reply.status in (401, 403):
            raise ConfigError(f"the warm engine at {self.url} refused the key (HTTP {reply.status}): "
                              "check ENGINE_API_KEY")
        try:
            cards = reply.json()["data"]
            if not all(isinstance(card, dict) and "id" in card for card in cards):
                raise TypeError("an entry without an id")
            return list(cards)
        except (ValueError, KeyError, TypeError):
            raise EngineUnavailable(f"{self.url}/v1/models answered HTTP {reply.status} without a model "
                                    f"list: {reply.text[:200]!r}; is this vLLM's OpenAI-compatible server?") from None

    def alive(self) -> bool:
        """Whether the server answers /health within SHORT_SECONDS, other than with a 5xx (vLLM's
        /health says 503 when its engine is dead; a proxy without the route still answers 404)."""
        try:
            return self.request("GET", "/health", timeout=SHORT_SECONDS).status < 500
        except (OSError, http.client.HTTPException):
            return False

    def post(self, path: str, body: dict[str, Any], request_id: str, stop: threading.Event | None = None,
             sent: "Sent | None" = None) -> Reply:
        return self.request("POST", path, body, {"X-Request-Id": request_id}, stop=stop, sent=sent)

    def abort(self) -> None:
        """Shut down every connection, those waiting for an answer too: the server aborts their requests."""
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.abort()


@dataclass
class Sent:
    """One request on its way: the line, the batch it is of, and the stream's stop (set when the
    stream is closed: the request is then neither waited for nor sent again)."""

    req: contract.BatchRequest
    batch_id: str
    stop: threading.Event
    url: str = ""  # the server that answers it
    model: str = ""  # the name that server serves it as
    at: float = field(default_factory=time.monotonic)  # when it was taken from the stream
    conn: Any = field(default=None, repr=False)  # the connection it is on, once posted
    pulled: threading.Event = field(default_factory=threading.Event, repr=False)  # pulled back for an urgent run

    def pull_back(self) -> None:
        """Close its connection (the server aborts the request) and hold it until its turn comes."""
        self.pulled.set()
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: answered, or dropped


class Stopped(Exception):
    """The stream was closed while this request was out: nobody takes its answer."""


@dataclass
class EngineFigures:
    """The server's own figures over one stream (its /metrics, read at the start and the end, and
    sampled between): the tokens it computed for anyone in that time, and how busy it was."""

    seconds: float
    tokens: float  # prompt tokens not found in its prefix cache, plus generated ones: every user's
    busy_share: float | None  # the share of samples with a request running (None: no sample)
    url: str = ""  # the server's

    def share_of(self, tokens: int) -> float:
        """A stream's share of the engine by the tokens it computed (the cost rule of a shared engine)."""
        return min(1.0, tokens / self.tokens) if self.tokens > 0 else 1.0


COUNTERS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total")
METER_SECONDS = 0.5  # how often the server's running count is sampled while a stream answers


def prometheus_sums(text: str) -> dict[str, float]:
    """A Prometheus text page as {metric name: value summed over its label sets}."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[-1]
            try:
                sums[name] = sums.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return sums


class EngineMeter:
    """Reads the server's counters when a stream starts and ends, and samples whether it is running
    anything every METER_SECONDS in between (its own thread and connection). A server whose /metrics
    cannot be read gives no figures; answering goes on regardless."""

    def __init__(self, client: "EngineClient") -> None:
        self.client = client
        self.samples = self.busy = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[str, float] | None = None
        self._began = 0.0

    def _read(self) -> dict[str, float] | None:
        try:
            reply = self.client.request("GET", "/metrics", timeout=SHORT_SECONDS)
            return prometheus_sums(reply.text) if reply.status == 200 else None
        except (OSError, http.client.HTTPException):
            return None

    def _sample(self) -> None:
        while not self._stop.wait(METER_SECONDS):
            figures = self._read()
            if figures is not None and "vllm:num_requests_running" in figures:
                self.samples += 1
                self.busy += figures["vllm:num_requests_running"] > 0

    def start(self) -> None:
        self._first, self._began = self._read(), time.monotonic()
        self._thread = threading.Thread(target=self._sample, name="warm-engine-meter", daemon=True)
        self._thread.start()

    def stop(self) -> EngineFigures | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        last = self._read()
        if self._first is None or last is None:
            return None
        delta = {name: last.get(name, 0.0) - self._first.get(name, 0.0) for name in COUNTERS}
        tokens = delta[COUNTERS[0]] - delta[COUNTERS[1]] + delta[COUNTERS[2]]
        return EngineFigures(round(time.monotonic() - self._began, 3), tokens,
                             round(self.busy / self.samples, 4) if self.samples else None, self.client.url)


class RemoteEngines:
    """The engines of one run when ENGINE_URL names a warm engine: the same interface as
    engine/local.Engines (stream, close, the figures steps/inference.py records)."""

    data_parallel_size = 1
    rank_peak_memory_mb: list[float] = []
    clock = None  # the server's own steps are not seen from here (its /metrics are)

    def __init__(self, settings: EngineSettings, served_name: str, local: Callable[[], Any],
                 priority: int = 0, log: Callable[[str], None] = lambda _m: None,
                 pooling: dict[str, str] | None = None) -> None:
        """`pooling`: the pooling models' warm engines (pooling_routes), for embeddings, score and rerank."""
        self.settings = settings
        self.served_name = served_name
        self.routes = warm_routes(settings, served_name)  # generation: served model name -> its server's URL
        self.pooling = dict(pooling or {})  # embeddings, score, rerank: served model name -> its server's URL
        self.url = (base_url(settings.engine_url) if settings.engine_url
                    else next(iter({**self.pooling, **self.routes}.values()), ""))
        self.batch_priority = int(priority)  # ours (higher sooner); each request's vLLM priority: vllm_priority
        self.log = log
        self.load_seconds = 0.0  # no model is loaded by the run
        self.window = Window(window_size(settings), start_window(settings))
        # ENGINE_API_KEY goes to every warm engine of the run (one key for the deployment's engines).
        self.clients = {url: EngineClient(url, settings.engine_api_key)
                        for url in {*self.routes.values(), *self.pooling.values()}}
        self._local_factory, self._local = local, None  # in-process engines for what no server serves
        # Plain names of versioned models answer with the version this run is pinned to (as in-process).
        self.aliases = {name: versioned_name(name, version) for name, version in settings.resolved_versions({}).items()}
        self.figures: EngineFigures | None = None  # the server's figures over the last stream (one server)
        # Who outranks this run on its engine now (a sentence naming the run), or None: see "Yielding".
        self.outranked: Callable[[], str | None] = lambda: None
        self._yielding: str | None = None
        self._at_server = 0  # this run's requests at the server now
        self._lock = threading.Lock()
        # A held (pulled-back) request's turn: signalled when one of this run's requests leaves the
        # server, when the run stops yielding, and when the stream ends.
        self._turn = threading.Condition(self._lock)
        self._last_answer: dict[str, float] = {}  # URL -> when it last answered (monotonic)
        self._unhealthy: dict[str, float] = {}  # URL -> since when its /health has not answered (monotonic)
        self.image_settings = images.image_settings_from_env()
        self.served = self.check()

    def check(self) -> dict[str, list[str]]:
        """Before any request: every server answers and serves the models routed to it (of a versioned
        model, the version this run is pinned to; another version a line names is that line's error)."""
        served = {}
        versions = {name for name in self.routes if VERSION_SEP in name}
        required = (set(self.routes) - versions) | (set(self.aliases.values()) & versions) | set(self.pooling)
        where = {**self.pooling, **self.routes}
        for url, client in self.clients.items():
            served[url] = client.models()
            missing = sorted(name for name in required if where[name] == url and name not in served[url])
            if missing:
                raise ConfigError(f"the warm engine at {url} serves {', '.join(served[url]) or 'no model'}, not "
                                  f"{', '.join(missing)} (SERVED_MODEL_NAME / LORA_MODULES / MODELS_FILE's url / "
                                  "EMBEDDING_ENGINE_URL / SCORE_ENGINE_URL): start it with this model, or point the "
                                  "URL at the server that has it")
            self.log(f"answering {', '.join(sorted(n for n, to in where.items() if to == url))} on the warm "
                     f"engine at {url} (serves {', '.join(served[url])}; up to {self.window.ceiling} requests in flight, "
                     f"{self.window.start} at first, "
                     f"batch priority {self.batch_priority}, then each request by its prompt prefix)")
        return served

    @property
    def takes_at_once(self) -> int:
        """The longest stream that fits the window: its order is then the server's, not a plan's."""
        return self.window.ceiling

    @property
    def client(self) -> EngineClient:
        """The client of ENGINE_URL's server (or of the only one)."""
        return self.clients[self.url]

    def route(self, req: contract.BatchRequest) -> tuple[str, str] | None:
        """(the URL of the server that answers this request, the model name it serves it as), or None:
        a generation line of a model (or adapter) with a warm engine, or a pooling line (embeddings,
        score, rerank) of a pooling model with one."""
        model = req.body.get("model") if isinstance(req.body, dict) else None
        if req.url in GENERATION_URLS:
            model, table = self.aliases.get(model, model), self.routes
        elif req.url in POOLING_URLS:
            table = self.pooling
        else:
            return None
        if model not in table:
            return None
        return table[model], model

    def stream(self, batch_id: str, requests: Iterable[contract.BatchRequest], created: int,
               expected: int | None = None) -> Iterator[Answer]:
        """Every request answered once, in the order answers come back; the server's lines first,
        then (if any) the lines it does not serve, in-process."""
        others: list[contract.BatchRequest] = []
        pool = cf.ThreadPoolExecutor(max_workers=self.window.ceiling, thread_name_prefix="warm-engine")
        flying: dict[cf.Future[Answer], Sent] = {}
        stop = threading.Event()
        source = iter(requests)
        exhausted = False
        # The server's figures when it is the only one (a run's tokens are then all its own share).
        meter = EngineMeter(EngineClient(self.url, self.settings.engine_api_key)) if len(self.clients) == 1 else None
        if meter is not None:
            meter.start()
        quiet_since = time.monotonic()  # the last answer (or the start)
        try:
            while True:
                while not exhausted and len(flying) < self._in_flight(flying.values()):
                    req = next(source, None)
                    if req is None:
                        exhausted = True
                        break
                    if not isinstance(req, contract.BatchRequest):
                        continue  # NOTHING_YET: a data-parallel feeder's "not yet" has no meaning here
                    routed = self.route(req)
                    if routed is None:
                        others.append(req)
                        continue
                    sent = Sent(req, req.batch_id or batch_id, stop, *routed)
                    flying[pool.submit(self._ask, sent, created)] = sent
                if not flying:
                    if exhausted:
                        break
                    continue
                # Awake every YIELD_CHECK_SECONDS, so that a more urgent run is seen even while no
                # answer comes (a long decode); the server is asked whether it lives after
                # STALL_CHECK_SECONDS without one.
                done, _ = cf.wait(flying, timeout=min(YIELD_CHECK_SECONDS, STALL_CHECK_SECONDS),
                                  return_when=cf.FIRST_COMPLETED)
                if not done:
                    if time.monotonic() - quiet_since >= STALL_CHECK_SECONDS:
                        self._check_alive({sent.url for sent in flying.values()})
                        quiet_since = time.monotonic()
                    continue
                quiet_since = time.monotonic()
                failed = None
                for future in done:
                    del flying[future]
                    if future.exception() is None:
                        yield future.result()
                    else:
                        failed = failed or future.exception()
                if failed is not None:
                    raise failed  # EngineUnavailable: the stream ends, every answer before it taken
        finally:
            stop.set()
            with self._turn:
                self._turn.notify_all()  # held requests see the stop at once
            # Interrupted: the servers abort what they hold for these connections. Done: idle ones
            # are not kept for the next stream (its threads are new).
            for client in self.clients.values():
                client.abort()
            pool.shutdown(wait=False, cancel_futures=True)
            if meter is not None:
                self.figures = meter.stop()
                meter.client.close()
        if others:
            self.log(f"{len(others)} request(s) the warm engine does not serve (other models, embeddings, "
                     "score): answering them in this process")
            yield from self._local_engines().stream(batch_id, others, created)

    def _in_flight(self, flying: Iterable[Sent]) -> int:
        """How many requests may be in flight now: the window, or YIELD_WINDOW while outranked. When
        a more urgent run appears, all but the YIELD_WINDOW oldest of those in flight are pulled back:
        their connections closed (the server aborts them) and each held until its turn comes again."""
        outranked = self.outranked()
        if (outranked is None) != (self._yielding is None):
            if outranked:
                later = sorted(flying, key=lambda sent: sent.at)[YIELD_WINDOW:]
                self.log(f"{outranked}: this run keeps at most {YIELD_WINDOW} requests in flight until it is "
                         f"done ({len(later)} pulled back, to go again then)")
                for sent in later:
                    sent.pull_back()
            else:
                self.window.restart()  # the held requests go again as the window grows, not all at once
                self.log(f"no run of higher priority answers on the warm engine now: back to "
                         f"{self.window.now()} requests in flight, one more per answer up to {self.window.ceiling}")
                with self._turn:
                    self._turn.notify_all()
        self._yielding = outranked
        return min(self.window.now(), YIELD_WINDOW) if outranked else self.window.now()

    def _take_turn(self, sent: Sent) -> None:
        """Count the request at the server, once it may go: at once, or for one pulled back, when no
        run outranks this one any more or fewer than YIELD_WINDOW of its requests are at the server."""
        with self._turn:
            while (sent.pulled.is_set() and not sent.stop.is_set() and self.outranked() is not None
                   and self._at_server >= YIELD_WINDOW):
                self._turn.wait(YIELD_CHECK_SECONDS)  # signalled; the timeout only backs that up
            sent.pulled.clear()
            self._at_server += 1

    def _local_engines(self) -> Any:
        if self._local is None:
            self._local = self._local_factory()
        return self._local

    def _ask(self, sent: Sent, created: int) -> Answer:
        """One request to the server until it is answered; the line's answer (an output line, or the
        error line the server's refusal amounts to)."""
        req = sent.req
        try:  # images fetched and checked here, as in-process; the server gets them as data: URLs
            body = images.inline_images(req.url, req.body, self.image_settings)
        except images.ImageError as e:
            return lines.contract_error(sent.batch_id, req, contract.INVALID_REQUEST, str(e))
        for field_name in contract.IGNORED_FIELDS:  # accepted and ignored in-process; some refused by vLLM
            body.pop(field_name, None)
        if "priority" not in body:
            rank = prefix_rank(req.url, req.body) if req.url in GENERATION_URLS else 0
            body["priority"] = vllm_priority(self.batch_priority, rank, time.time())
        body["model"] = sent.model  # a versioned model's plain name: the version this run is pinned to
        request_id = ids.request_id(sent.batch_id, req.line)
        backoff, errors = BACKOFF_FIRST, 0
        while True:
            self._take_turn(sent)  # counted at the server until the finally below
            try:
                if sent.stop.is_set():
                    raise Stopped(req.line)
                reply = self._post(sent, body, request_id)
                if reply.status not in RETRY_STATUSES:
                    self._answered(sent.url)
                    return answer_of(sent, reply, created, sent.url)
                if reply.status == 500 and _error_message(_json_or_none(reply)):
                    # The server's error for this request (a parser that failed on its output, ...):
                    # tried again, and then that line's error, as in-process.
                    self._answered(sent.url)
                    errors += 1
                    if errors >= LINE_ERROR_TRIES:
                        return answer_of(sent, reply, created, sent.url)
                problem = f"HTTP {reply.status}"
            except (OSError, http.client.HTTPException) as e:  # refused, reset, dropped, timed out
                if sent.pulled.is_set():
                    continue  # pulled back for a more urgent run: no fault of the server
                problem = type(e).__name__
            finally:
                with self._turn:
                    self._at_server -= 1
                    self._turn.notify()
            silent = self._silent_for(sent.url)
            if silent >= self.settings.engine_wait_seconds:
                raise EngineUnavailable(
                    f"the warm engine at {sent.url} has not answered for {silent:.0f} s ({problem}; "
                    f"ENGINE_WAIT_SECONDS={self.settings.engine_wait_seconds:g}): the run stops; its answers are "
                    "checkpointed and the next run resumes from them")
            if backoff == BACKOFF_FIRST:
                self.log(f"the warm engine at {sent.url} did not take line {req.line} ({problem}); "
                         "sending it again as it comes back")
            self.window.shrink()
            sent.stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    def _post(self, sent: Sent, body: dict[str, Any], request_id: str) -> Reply:
        """The line's request. A completion of several prompts goes as one request per prompt, one
        after another, their answers merged as the server merges them (merged_completions): vLLM's
        server counts the cached tokens of a request's last prompt only, the in-process engine every
        prompt's. A prompt refused or pushed back is the whole line's reply, as in one request."""
        client, prompts = self.clients[sent.url], body.get("prompt")
        if sent.req.url != contract.COMPLETIONS_URL or not isinstance(prompts, list) or len(prompts) < 2:
            return client.post(sent.req.url, body, request_id, stop=sent.stop, sent=sent)
        replies = []
        for i, prompt in enumerate(prompts):
            reply = client.post(sent.req.url, {**body, "prompt": prompt}, f"{request_id}-{i}", stop=sent.stop, sent=sent)
            if reply.status != 200:
                return reply
            replies.append(reply)
        return merged_completions(replies)

    def _check_alive(self, urls: set[str]) -> None:
        """Nothing answered for STALL_CHECK_SECONDS: each of `urls` silent that long is asked for
        /health. A long decode on a live server is waited for; a server whose /health has stayed
        unanswered for ENGINE_WAIT_SECONDS stops the stream, naming it (its connections are then
        shut, and the answers so far are checkpointed)."""
        now = time.monotonic()
        for url in sorted(urls):
            if self._silent_for(url) < STALL_CHECK_SECONDS:
                continue
            if self.clients[url].alive():
                self._unhealthy.pop(url, None)
                continue
            since = self._unhealthy.setdefault(url, now)
            if since == now:
                self.log(f"the warm engine at {url} has answered nothing for {self._silent_for(url):.0f} s and "
                         "not its /health either: waiting for it up to ENGINE_WAIT_SECONDS")
            if now - since >= self.settings.engine_wait_seconds:
                raise EngineUnavailable(
                    f"the warm engine at {url} holds this run's requests but has answered nothing for "
                    f"{self._silent_for(url):.0f} s, nor /health for {now - since:.0f} s (hung?; "
                    f"ENGINE_WAIT_SECONDS={self.settings.engine_wait_seconds:g}): the run stops; its answers are "
                    "checkpointed and the next run resumes from them")

    def _answered(self, url: str) -> None:
        with self._lock:
            self._last_answer[url] = time.monotonic()
        self.window.grow()

    def _silent_for(self, url: str) -> float:
        """Seconds since the server last answered anything (any line's request), or since the first
        request of this run that found it away: the server is out, not one line."""
        now = time.monotonic()
        with self._lock:
            since = self._last_answer.setdefault(url, now)
        return now - since

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        if self._local is not None:
            if self._local.owns:  # as LLMResource.open: engines shared beyond the run (tests') stay up
                self._local.close()
            self._local = None


# -- the server's answer as the line's result ----------------------------------------------------


def answer_of(sent: Sent, response: Reply, created: int, url: str) -> Answer:
    """The result line of one request from the server's HTTP answer: the body made the in-process
    engine's (ids, created, usage details) on 200; the refusal as the same error line otherwise; an
    answer that is not an OpenAI body is that line's error, never a crash."""
    req, batch_id = sent.req, sent.batch_id
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status != 200:
        message = _error_message(payload) or response.text[:300] or f"HTTP {response.status}"
        if response.status == 400 and "maximum context length" in message:
            return lines.contract_error(batch_id, req, contract.CONTEXT_LENGTH_EXCEEDED, message)
        return lines.engine_error(batch_id, req, RuntimeError(message), status=response.status)
    try:
        shaped = BODY_SHAPES[req.url](batch_id, req, payload, created) if isinstance(payload, dict) else None
    except (AttributeError, TypeError, ValueError, KeyError):  # OpenAI's keys, but not its shapes
        shaped = None
    if shaped is None:
        return lines.engine_error(batch_id, req, RuntimeError(
            f"the warm engine at {url} answered {req.url} with a body that is not OpenAI's: {response.text[:200]!r}"),
            status=502)
    body, prompt, completion, reasoning, cached = shaped
    return lines.success(batch_id, req, body, prompt, completion, reasoning, cached)


def merged_completions(replies: list[Reply]) -> Reply:
    """One text_completion from the answers to a line's prompts sent one by one: the choices in prompt
    order, numbered on (as the server numbers them: a prompt's n choices, then the next prompt's), and
    the usage summed, cached tokens included. An answer that is not a completion is returned as it is
    (answer_of makes it the line's error)."""
    payloads, sums = [], (0, 0, 0, 0)
    for reply in replies:
        payload = _json_or_none(reply)
        try:
            if not isinstance(payload["choices"], list) or not isinstance(payload["usage"], dict):
                return reply
            sums = tuple(a + b for a, b in zip(sums, _completion_counts(payload["usage"])))
        except (AttributeError, KeyError, TypeError, ValueError):
            return reply
        payloads.append(payload)
    choices: list[Any] = []
    for payload in payloads:
        choices += [{**c, "index": len(choices) + i} if isinstance(c, dict) else c for i, c in enumerate(payload["choices"])]
    return Reply(200, json.dumps({**payloads[0], "choices": choices, "usage": _completion_usage(*sums)}).encode())


def _json_or_none(reply: Reply) -> Any:
    try:
        return reply.json()
    except ValueError:
        return None


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            return str(error.get("message") or "")
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
    return ""


Shaped = tuple[dict[str, Any], int, int, int, int]  # (body, prompt, completion, reasoning, cached tokens)


def _completion_shape(prefix: str, batch_id: str, req: contract.BatchRequest, payload: dict[str, Any],
                      created: int) -> Shaped | None:
    """chat.completion / text_completion: the in-process ids, usage details and fingerprint."""
    choices, usage = payload.get("choices"), payload.get("usage")
    if not isinstance(choices, list) or not isinstance(usage, dict):
        return None
    body = copy.deepcopy(payload)
    body.update(id=ids.completion_id(prefix, batch_id, req.line), created=created, system_fingerprint=None)
    for i, choice in enumerate(body["choices"]):
        if isinstance(choice, dict):
            # vLLM's own field, filled for an echoed line with logprobs (token ids -> logprobs, in every
            # choice): those logprobs are already in `logprobs`, in OpenAI's shape, as in-process has them.
            choice.pop("prompt_logprobs", None)
        message = choice.get("message") if isinstance(choice, dict) else None
        for j, call in enumerate((message or {}).get("tool_calls") or []):
            if isinstance(call, dict):
                call["id"] = ids.tool_call_id(batch_id, req.line, i, j)
    prompt, completion, reasoning, cached = _completion_counts(usage)
    body["usage"] = _completion_usage(prompt, completion, reasoning, cached)
    return body, prompt, completion, reasoning, cached


def _completion_counts(usage: dict[str, Any]) -> tuple[int, int, int, int]:
    """(prompt, completion, reasoning, cached) tokens of a chat or text completion's usage; a count that is
    missing or null (details the server was not asked for) is 0."""
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = int(((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return prompt, completion, reasoning, cached


def _completion_usage(prompt: int, completion: int, reasoning: int, cached: int) -> dict[str, Any]:
    """A completion's usage as the in-process engine writes it."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _response_shape(batch_id: str, req: contract.BatchRequest, payload: dict[str, Any], created: int) -> Shaped | None:
    """A `response` (/v1/responses): the in-process ids of the response and its output items."""
    output, usage = payload.get("output"), payload.get("usage")
    if not isinstance(output, list) or not isinstance(usage, dict):
        return None
    body = copy.deepcopy(payload)
    body.update(id=ids.response_id(batch_id, req.line), created_at=created)
    prefixes = {"message": "msg", "reasoning": "rs"}
    for item in body["output"]:
        if isinstance(item, dict) and item.get("type") in prefixes:
            item["id"] = ids.response_item_id(prefixes[item["type"]], batch_id, req.line)
    calls = [item for item in body["output"] if isinstance(item, dict) and item.get("type") == "function_call"]
    for j, item in enumerate(calls):
        item["call_id"] = ids.tool_call_id(batch_id, req.line, 0, j)
        item["id"] = "fc_" + item["call_id"].removeprefix("call_")
    prompt, completion = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
    cached = int(((usage.get("input_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = int(((usage.get("output_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return body, prompt, completion, reasoning, cached


def _pooling_tokens(payload: dict[str, Any]) -> int:
    usage = payload["usage"]
    return int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)


def _embeddings_shape(batch_id: str, req: contract.BatchRequest, payload: dict[str, Any], created: int) -> Shaped | None:
    """An embeddings list as in-process (engine/bodies.embeddings_body): no id or created of the server's."""
    data = payload.get("data")
    if not isinstance(data, list) or not all(isinstance(d, dict) and "embedding" in d for d in data):
        return None
    prompt = _pooling_tokens(payload)
    body = {"object": "list",
            "data": [{"object": "embedding", "index": int(d.get("index", i)), "embedding": d["embedding"]}
                     for i, d in enumerate(data)],
            "model": payload.get("model"), "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
    return body, prompt, 0, 0, 0


def _score_shape(batch_id: str, req: contract.BatchRequest, payload: dict[str, Any], created: int) -> Shaped | None:
    """vLLM's ScoreResponse as in-process (engine/scoring.score_body): the pipeline's id and created."""
    data = payload.get("data")
    if not isinstance(data, list) or not all(isinstance(d, dict) and "score" in d for d in data):
        return None
    prompt = _pooling_tokens(payload)
    body = {"id": ids.completion_id("score", batch_id, req.line), "object": "list", "created": created,
            "model": payload.get("model"),
            "data": [{"index": int(d.get("index", i)), "object": "score", "score": float(d["score"])}
                     for i, d in enumerate(data)],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}}
    return body, prompt, 0, 0, 0


def _rerank_shape(batch_id: str, req: contract.BatchRequest, payload: dict[str, Any], created: int) -> Shaped | None:
    """vLLM's RerankResponse as in-process (engine/scoring.rerank_body): the pipeline's id; each
    result's document as {"text": ... or null}."""
    results = payload.get("results")
    if not isinstance(results, list) or not all(isinstance(r, dict) and "relevance_score" in r for r in results):
        return None
    prompt = _pooling_tokens(payload)
    body = {"id": ids.completion_id("rerank", batch_id, req.line), "model": payload.get("model"),
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": [{"index": int(r["index"]), "document": {"text": (r.get("document") or {}).get("text")},
                         "relevance_score": float(r["relevance_score"])} for r in results]}
    return body, prompt, 0, 0, 0


BODY_SHAPES: dict[str, Callable[[str, contract.BatchRequest, dict[str, Any], int], Shaped | None]] = {
    contract.CHAT_URL: lambda b, r, p, c: _completion_shape("chatcmpl", b, r, p, c),
    contract.COMPLETIONS_URL: lambda b, r, p, c: _completion_shape("cmpl", b, r, p, c),
    contract.RESPONSES_URL: _response_shape,
    contract.EMBEDDINGS_URL: _embeddings_shape,
    contract.SCORE_URL: _score_shape,
    contract.RERANK_URL: _rerank_shape,
}

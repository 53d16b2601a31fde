"""The warm engine (engine/remote.py): a run's requests answered by vLLM's OpenAI-compatible server.

Covered with the real server on the tiny model (warm_engine.py's, one for the module): a batch of chat,
completions and Responses lines gives the same result lines warm as in this process (greedy text,
finish reasons, token counts, deterministic ids), a prompt over MAX_MODEL_LEN the same
`context_length_exceeded` error line, and the run builds no engine of its own (loads no model); a
closed stream makes the server abort the requests it holds (its running count falls to 0 and it stops
generating); a completion line of several prompts counts every prompt's cached tokens (the server
counts the last one's). With stand-in servers (failure injection): 503s, 429s and dropped connections are waited
out with every line answered once; a server gone longer than ENGINE_WAIT_SECONDS fails naming its
URL, and so does one that holds its connections but answers neither them nor /health (a slow one
whose /health answers is waited for); a file run in its own process imports neither torch nor vLLM; at run start an unreachable URL or a server of another model is refused naming the URL and what
it serves; an answer that is not an OpenAI body is that line's error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from batch_pipeline.config.settings import ConfigError, EngineSettings
from batch_pipeline import contract
from batch_pipeline.contract import prompts
from batch_pipeline.engine.remote import (BATCH_SCALE, EPOCH_SECONDS, EngineUnavailable, RemoteEngines, Reply, Sent,
                                          Window, answer_of, base_url, merged_completions, start_window, vllm_priority,
                                          window_size)
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import EMBED_NAME, TINY_MAX_MODEL_LEN, TINY_NAME, wait_for
from batch_pipeline_tests.support.warm_engine import StandIn, chat_answer



def request(line: int, content: str = "hi", url: str = contract.CHAT_URL, **body: Any) -> contract.BatchRequest:
    if url == contract.CHAT_URL:
        payload = {"model": TINY_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}
    else:
        payload = {"model": TINY_NAME, "prompt": content, "max_tokens": 4, **body}
    return contract.BatchRequest(line=line, custom_id=f"c-{line}", url=url, body=payload)


def engines_at(url: str, **settings: Any) -> RemoteEngines:
    def no_local() -> Any:
        raise AssertionError("nothing here is for an in-process engine")

    return RemoteEngines(EngineSettings(engine_url=url, **settings), TINY_NAME, no_local)


# -- the rules, without a server ------------------------------------------------------------------


def test_the_window_and_priority_follow_their_settings():
    assert window_size(EngineSettings()) == 64 and window_size(EngineSettings(batch_size=16)) == 32
    assert window_size(EngineSettings(batch_size=16, engine_window=5)) == 5
    assert base_url("http://h:8000/v1/") == "http://h:8000" == base_url("http://h:8000")
    window = Window(8)
    window.shrink(), window.shrink()
    assert window.now() == 2
    for _ in range(20):
        window.grow()
    assert window.now() == 8
    with pytest.raises(ConfigError, match="ENGINE_URL='localhost:8000' is not an http"):
        EngineSettings(engine_url="localhost:8000")
    with pytest.raises(ConfigError, match="ENGINE_WINDOW=0 is out of range"):
        EngineSettings(engine_window=0)
    assert start_window(EngineSettings()) == 8 and start_window(EngineSettings(engine_window=5)) == 5
    assert start_window(EngineSettings(engine_start_window=3)) == 3
    with pytest.raises(ConfigError, match="ENGINE_START_WINDOW=0 is out of range"):
        EngineSettings(engine_start_window=0)
    slow = Window(16, start=3)  # slow start: 3 at first, one more per answer, back to 3 after a pause
    assert slow.now() == 3
    for _ in range(20):
        slow.grow()
    assert slow.now() == 16
    slow.restart()
    assert slow.now() == 3
    slow.shrink(), slow.shrink(), slow.restart()
    assert slow.now() == 1  # a restart never raises it
    assert "secret-key" not in repr(EngineSettings(engine_url="http://h", engine_api_key="secret-key"))


def test_a_requests_vllm_priority_is_its_batch_then_its_minute_then_its_prefix():
    """vLLM runs lower priorities sooner (a heap on priority, then arrival). Ours: a higher batch
    priority always first; then an earlier minute, whatever the prefix (no run waits behind others'
    requests for longer than about a minute); within a minute, the users of one document together,
    in the same order in every run, so that concurrent file runs meet in the prefix cache."""
    t = 1_790_000_000.0
    assert vllm_priority(5, prompts.RANK_SPAN - 1, t + 3600) < vllm_priority(4, 0, t)  # ours: higher sooner
    assert vllm_priority(0, prompts.RANK_SPAN - 1, t) < vllm_priority(0, 0, t + EPOCH_SECONDS)
    assert vllm_priority(-1) == BATCH_SCALE and vllm_priority(0, 7, t) % prompts.RANK_SPAN == 7
    for batch in (-1000, 1000):  # the Batch API's bounds fit in vLLM's int64
        assert abs(vllm_priority(batch, prompts.RANK_SPAN - 1, t)) < 2**63
    docs = [f"Document {d}: " + f"the {d} facts. " * 120 for d in ("alpha", "beta", "gamma", "delta", "omega")]
    asks = [(d, q) for d in range(5) for q in range(6)]
    random.Random(3).shuffle(asks)

    def rank(d: int, q: int) -> int:
        body = {"model": TINY_NAME, "messages": [{"role": "system", "content": "Answer from the document."},
                                                 {"role": "user", "content": f"{docs[d]}\nQuestion {q}?"}]}
        return prompts.prefix_rank(contract.CHAT_URL, body)

    # Two runs, each a shuffled half of the questions: together, sorted by priority, each document's
    # questions are contiguous, and each run alone sees the documents in the same order.
    runs = [asks[::2], asks[1::2]]
    merged = sorted((vllm_priority(0, rank(d, q), t), d) for run in runs for d, q in run)
    order = [d for _, d in merged]
    assert [d for i, d in enumerate(order) if i == 0 or order[i - 1] != d] == sorted(set(order), key=order.index)
    assert len(set(order)) == 5
    each = [[d for _, d in sorted((rank(d, q), d) for d, q in run)] for run in runs]
    assert [list(dict.fromkeys(x)) for x in each] == [list(dict.fromkeys(order))] * 2


def test_a_shared_engines_time_is_split_by_tokens():
    from batch_pipeline.engine.remote import EngineFigures, prometheus_sums

    page = ('# HELP vllm:generation_tokens_total x\nvllm:generation_tokens_total{engine="0",model_name="m"} 30.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="m"} 12.0\nvllm:num_requests_running{engine="0"} 2.0\n')
    assert prometheus_sums(page) == {"vllm:generation_tokens_total": 42.0, "vllm:num_requests_running": 2.0}
    shared = EngineFigures(seconds=10.0, tokens=400.0, busy_share=0.5)
    assert shared.share_of(100) == 0.25 and shared.share_of(800) == 1.0  # never more than the whole
    assert EngineFigures(seconds=1.0, tokens=0.0, busy_share=None).share_of(5) == 1.0


def answer(status: int, payload: Any, req: contract.BatchRequest | None = None) -> Any:
    req = req or request(3)
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return answer_of(Sent(req, "batch_x", threading.Event()), Reply(status, content), 1700000000, "http://e:1")


def test_the_servers_answers_become_the_in_process_lines():
    body = chat_answer(request(3).body, "hello there")
    body["choices"][0]["message"]["tool_calls"] = [{"id": "chatcmpl-tool-random", "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]
    ok = answer(200, body)
    assert ok.kind == "output" and (ok.prompt_tokens, ok.completion_tokens) == (7, 2)
    out = ok.record["response"]["body"]
    again = answer(200, chat_answer(request(3).body, "hello there"))
    assert out["id"] == again.record["response"]["body"]["id"] and out["id"].startswith("chatcmpl-")  # deterministic
    assert out["created"] == 1700000000 and out["system_fingerprint"] is None
    assert out["choices"][0]["message"]["tool_calls"][0]["id"].startswith("call_")
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert ok.record["custom_id"] == "c-3" and ok.record["response"]["status_code"] == 200
    over = answer(400, {"error": {"message": "This model's maximum context length is 512 tokens. However, your "
                                             "prompt contains at least 513 input tokens", "type": "BadRequestError"}})
    assert over.kind == "error" and over.record["error"]["code"] == contract.CONTEXT_LENGTH_EXCEEDED
    assert "line 3" in over.record["error"]["message"]
    refused = answer(400, {"error": {"message": "temperature must be non-negative", "type": "BadRequestError"}})
    assert refused.record["response"]["status_code"] == 400
    assert refused.record["response"]["body"]["error"]["message"] == "temperature must be non-negative"
    for garbage in (b"<html>busy</html>", {"object": "chat.completion"}, [1, 2]):
        bad = answer(200, garbage)
        assert bad.kind == "error" and bad.record["response"]["status_code"] == 502
        assert "http://e:1" in bad.record["response"]["body"]["error"]["message"]


def test_the_answers_to_a_lines_prompts_merge_as_one_completion():
    """A completion line of several prompts is sent one prompt at a time (see the real server's test
    below); the answers become the one body the server gives: choices numbered on, usage summed."""
    def completion(texts: list[str], prompt: int, cached: int) -> Reply:
        body = {"id": "cmpl-x", "object": "text_completion", "created": 5, "model": TINY_NAME,
                "choices": [{"index": i, "text": t, "finish_reason": "length"} for i, t in enumerate(texts)],
                "usage": {"prompt_tokens": prompt, "completion_tokens": len(texts), "total_tokens": prompt + len(texts),
                          "prompt_tokens_details": {"cached_tokens": cached}}}
        return Reply(200, json.dumps(body).encode())

    merged = merged_completions([completion(["a", "b"], 10, 0), completion(["c", "d"], 12, 8)]).json()
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert merged["usage"] == {"prompt_tokens": 22, "completion_tokens": 4, "total_tokens": 26,
                               "prompt_tokens_details": {"cached_tokens": 8},
                               "completion_tokens_details": {"reasoning_tokens": 0}}
    for odd in (Reply(200, b'{"object": "text_completion"}'), Reply(200, b"<html>busy</html>"),
                Reply(200, b'{"choices": [], "usage": {"prompt_tokens": "many"}}')):
        assert merged_completions([completion(["a"], 3, 0), odd]) is odd  # returned as it is: the line's error
    bare = json.loads(completion(["a"], 3, 0).data)
    bare["usage"]["prompt_tokens_details"] = None  # a server not asked for the details
    merged = merged_completions([Reply(200, json.dumps(bare).encode())] * 2).json()
    assert merged["usage"]["prompt_tokens"] == 6 and merged["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


# -- failure injection: stand-in servers ----------------------------------------------------------


def test_push_back_and_dropped_connections_are_waited_out_with_every_line_answered_once():
    def script(n: int, body: dict[str, Any]) -> tuple[int, Any] | None:
        if n in (2, 5, 9):
            return None  # the connection dropped with the request in flight
        if n in (3, 4, 6):
            return (503, {"error": {"message": "busy"}}) if n != 6 else (429, {"error": {"message": "slow down"}})
        return 200, chat_answer(body)

    server = StandIn(script)
    logged: list[str] = []
    try:
        engines = engines_at(server.url, engine_window=4)
        engines.log = logged.append
        answers = list(engines.stream("batch_x", [request(i, f"q{i}") for i in range(1, 21)], created=1))
    finally:
        server.stop()
    assert sorted(a.line for a in answers) == list(range(1, 21)) and all(a.kind == "output" for a in answers)
    assert sorted(server.answered.values()) == [1] * 20  # each line's request answered once
    assert server.posts == 26 and any("sending it again" in m for m in logged), (server.posts, logged)
    bodies = {a.line: a.record["response"]["body"]["choices"][0]["message"]["content"] for a in answers}
    assert bodies[7] == "echo q7"


class AtOnce:
    """A stand-in server's script that counts its requests being answered at once: each request
    appends (moment(), how many, itself included) to `peaks` as it arrives, waits `hold(n)`, and is
    answered."""

    def __init__(self, hold: Any, moment: Any = lambda: None) -> None:
        self.hold, self.moment = hold, moment
        self.lock, self.now, self.peaks = threading.Lock(), 0, []

    def __call__(self, n: int, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            self.now += 1
            self.peaks.append((self.moment(), self.now))
        self.hold(n)
        with self.lock:
            self.now -= 1
        return 200, chat_answer(body)


@pytest.mark.slow  # 16 answers held 0.2 s each, some in a row: 3-4 s
def test_a_run_sends_its_start_window_first_and_grows_it_by_one_per_answer():
    """ENGINE_START_WINDOW requests at first, not the whole window: the server holds the first three
    unanswered, and no fourth comes; once they are answered the run has more in flight than its
    start, growing towards ENGINE_WINDOW. Every line is answered once."""
    held = threading.Event()
    # the first three held until the test lets them go; then a request's time at the server, long
    # enough that answers overlap even when this process is starved (at 0.05 s the peak stayed at 9
    # of 16 on a loaded machine: CI of 56707e4)
    script = AtOnce(lambda n: held.wait(30) if n <= 3 else time.sleep(0.2))
    server = StandIn(script)
    answers: list[Any] = []
    try:
        engines = engines_at(server.url, engine_window=16, engine_start_window=3)
        runner = threading.Thread(target=lambda: answers.extend(
            engines.stream("bulk", [request(i, f"q{i}") for i in range(1, 81)], created=1)))
        runner.start()
        wait_for("the first three requests at the server", lambda: server.posts >= 3, 30)
        time.sleep(0.5)
        assert server.posts == 3, "more than ENGINE_START_WINDOW requests went before any answer"
        held.set()
        runner.join(60)
    finally:
        held.set()
        server.stop()
    assert sorted(a.line for a in answers) == list(range(1, 81)) and all(a.kind == "output" for a in answers)
    peaks = [n for _, n in script.peaks]
    assert max(peaks) >= 10, peaks  # grown well past the start, towards the window's 16
    assert max(peaks) <= 16


@pytest.mark.slow
def test_an_outranked_run_pulls_back_and_keeps_few_requests_in_flight_then_grows_back():
    """While `outranked()` names a more urgent run on the engine, at most YIELD_WINDOW of this run's
    requests are at the server: those in flight beyond the oldest YIELD_WINDOW are pulled back (their
    connections closed, so a real server aborts them) and go again later; before and after, its whole
    window is there. Every line is answered once all the same."""
    from batch_pipeline.engine.remote import YIELD_WINDOW

    urgent: dict[str, str | None] = {"who": None}
    # a request's time at the server, so that the window fills
    script = AtOnce(lambda n: time.sleep(0.15), moment=lambda: urgent["who"] is not None)
    server = StandIn(script)
    peaks = script.peaks
    logged: list[str] = []
    try:
        engines = engines_at(server.url, engine_window=8)
        engines.log = logged.append
        engines.outranked = lambda: urgent["who"]
        answers = []
        for answer in engines.stream("bulk", [request(i, f"q{i}") for i in range(1, 121)], created=1):
            answers.append(answer)
            if len(answers) == 30:
                urgent["who"] = "run urgent-1 (priority 10, this run's 0) is answering on the engine"
            elif len(answers) == 80:
                urgent["who"] = None
    finally:
        server.stop()
    assert sorted(a.line for a in answers) == list(range(1, 121)) and all(a.kind == "output" for a in answers)
    before = [n for yielding, n in peaks[:30] if not yielding]
    # Sent while the urgent run answered; the first few still count those pulled back, which the
    # stand-in (unlike vLLM) goes on "answering" for their 0.15 s.
    during = [n for yielding, n in peaks if yielding][8:]
    # (the window's 8 at once, give or take an answer on its way back)
    assert max(before) >= 6 and during and max(during) <= YIELD_WINDOW, (max(before), during)
    last_yielding = max(i for i, (yielding, _) in enumerate(peaks) if yielding)
    assert max(n for _, n in peaks[last_yielding + 1:]) >= 6  # grown back
    pulled = [m for m in logged if "run urgent-1" in m and f"at most {YIELD_WINDOW} requests" in m]
    # those in flight when it was seen (the window less the answers just taken), less the oldest two
    assert len(pulled) == 1 and re.search(r"\((\d+) pulled back", pulled[0]), logged
    assert 1 <= int(re.search(r"\((\d+) pulled back", pulled[0])[1]) <= 8 - YIELD_WINDOW
    assert server.posts > 120  # the pulled-back requests went twice: once aborted, once answered
    assert any("back to" in m for m in logged) and not any("did not take" in m for m in logged), logged


def test_images_go_to_the_server_inline_and_a_bad_one_is_its_lines_error():
    from batch_pipeline_tests.support.image_data import data_url, png

    bodies: list[dict[str, Any]] = []
    server = StandIn(lambda n, body: (bodies.append(body), (200, chat_answer(body)))[1])
    picture = data_url(png("blue", (8, 8)))
    good = request(1, "?")
    good.body["messages"][0]["content"] = [{"type": "text", "text": "what?"},
                                           {"type": "image_url", "image_url": {"url": picture}}]
    bad = request(2, "?")
    bad.body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]
    try:
        answers = {a.line: a for a in engines_at(server.url).stream("batch_x", [good, bad], created=1)}
    finally:
        server.stop()
    assert answers[1].kind == "output" and [b["messages"][0]["content"][1]["image_url"]["url"] for b in bodies] == [picture]
    assert answers[2].kind == "error" and answers[2].record["error"]["code"] == contract.INVALID_REQUEST
    assert "body.messages[0].content[0].image_url" in answers[2].record["error"]["message"]
    assert server.posts == 1  # the bad line never reached the server


def test_each_model_goes_to_its_own_warm_engine_and_the_rest_stays_in_process(tmp_path):
    """ENGINE_URL serves the default model; a MODELS_FILE entry with a `url` is sent there (a versioned
    one as the version the run is pinned to); an entry without one is answered in-process."""
    seen: dict[str, list[str]] = {"a": [], "b": []}
    a = StandIn(lambda n, body: (seen["a"].append(body["model"]), (200, chat_answer(body)))[1])
    b = StandIn(lambda n, body: (seen["b"].append(body["model"]), (200, chat_answer(body)))[1],
                served=("other", "ver@v2"))
    models = tmp_path / "models.yaml"
    models.write_text(json.dumps({"other": {"path": "/models/other", "url": b.url},
                                  "ver": {"url": b.url, "current": "v2", "versions": {"v1": "/models/v1", "v2": "/models/v2"}},
                                  "local": {"path": "/models/local"}}))
    in_process: list[int] = []

    class Local:
        def stream(self, batch_id, requests, created):
            for req in requests:
                in_process.append(req.line)
                yield answer(200, chat_answer(req.body, "local"), req)

    lines = [request(1), request(2), request(3), request(4)]
    for req, model in zip(lines[1:], ("other", "ver", "local")):
        req.body["model"] = model
    try:
        engines = RemoteEngines(EngineSettings(engine_url=a.url, models_file=str(models)), TINY_NAME, Local)
        answers = {x.line: x for x in engines.stream("batch_x", lines, created=1)}
    finally:
        a.stop(), b.stop()
    # (sent at once, so in any order)
    assert {k: sorted(v) for k, v in seen.items()} == {"a": [TINY_NAME], "b": ["other", "ver@v2"]} and in_process == [4]
    assert sorted(answers) == [1, 2, 3, 4] and all(x.kind == "output" for x in answers.values())
    # The entry's url, not the default's: a server without the entry's model is refused at start.
    wrong = StandIn(lambda n, body: None, served=(TINY_NAME,))
    models.write_text(json.dumps({"other": {"path": "/models/other", "url": wrong.url}}))
    try:
        with pytest.raises(ConfigError, match=f"the warm engine at {wrong.url} serves tiny-llama, not other"):
            RemoteEngines(EngineSettings(engine_url=wrong.url, models_file=str(models)), TINY_NAME, Local)
    finally:
        wrong.stop()


def test_a_stream_that_fits_the_window_is_not_planned(tiny_llm, tmp_path):
    """All of a small batch goes to the warm engine at once, so its order is the server's: the run
    loads no tokenizer to plan it. A batch longer than the window is planned as in-process."""
    server = StandIn(lambda n, body: (200, chat_answer(body)))
    try:
        for name, count, window in (("small", 5, 64), ("large", 12, 4)):
            write_batch(tmp_path / "in" / DATE, f"{name}.jsonl",
                        [json.dumps({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": request(i, f"{name} {i}").body}) for i in range(count)])
            result = materialize(tiny_llm.rebuilt(engine_url=server.url, engine_window=window), str(tmp_path / "in"),
                                 str(tmp_path / name), run_config={"resources": {"batch": {"config": {
                                     "input_uri": str(tmp_path / "in" / DATE / f"{name}.jsonl")}}}})
            assert result.success
            info = json.loads((tmp_path / name / DATE / name / "_work" / "inference.json").read_text())
            assert info["computed_requests"] == count and info["model_load_seconds"] == 0
            assert (info["planning_seconds"] == 0) is (name == "small"), (name, info["planning_seconds"])
    finally:
        server.stop()


def run_beside(server: StandIn, script: str, **env: str) -> Any:
    """`script` in a Python process of its own with ENGINE_URL at the stand-in (and `env`), which is
    stopped after; the finished process (it must have exited 0)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "ENGINE_URL": server.url, "SERVED_MODEL_NAME": TINY_NAME, **env})
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("window", ["64", "2"], ids=["sent at once", "planned"])
def test_a_file_run_on_a_warm_engine_imports_neither_torch_nor_vllm(tmp_path, tiny_model_dir, window):
    """A run that sends every line to a warm engine is a light client: its own process (as a run
    worker is) answers a file through the stand-in without importing torch or vLLM (torch alone is
    1.5-4 s of a file run's start on 2 cores), nor transformers when it plans its order on the
    model's chat template (a window smaller than the file: steps/chat_template.py)."""
    server = StandIn(lambda n, body: (200, chat_answer(body)))
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "f.jsonl", [json.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": contract.CHAT_URL,
        "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}) for i in range(3)])
    script = f"""
import sys, dagster as dg
from batch_pipeline.defs.batch_files import batch_files
from batch_pipeline.defs.resources import BatchSelection, LLMResource, StorageResource
instance = dg.DagsterInstance.ephemeral()
instance.add_dynamic_partitions("batch_files", ["{DATE}/f"])
result = dg.materialize([batch_files], partition_key="{DATE}/f", instance=instance, resources={{
    "batch": BatchSelection(), "llm": LLMResource(),
    "storage": StorageResource(input_path={str(inbox)!r}, output_path={str(out)!r})}})
print(result.success, sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules))
"""
    done = run_beside(server, script, ENGINE_WINDOW=window, MODEL_PATH=str(tiny_model_dir))
    assert done.stdout.split("\n")[-2] == "True []", done.stdout
    logged = done.stderr + done.stdout
    assert ("planned the order of 3 requests" in logged) == (window == "2"), logged[-3000:]
    assert ("keyed on the chat template of" in logged) == (window == "2"), logged[-3000:]
    assert [r["custom_id"] for r in read_jsonl(str(out / DATE / "f" / "output.jsonl"))] == ["c-0", "c-1", "c-2"]
    assert server.posts == 3


@pytest.mark.slow
def test_batch_pipeline_run_on_a_warm_engine_imports_neither_torch_nor_vllm(tmp_path):
    """`batch-pipeline run` with ENGINE_URL is a light client too: its hardware check (GPUs counted
    through torch, 2.5 s of a run's start here) is for runs that load a model, so the command answers
    a file through the stand-in without importing torch or vLLM."""
    server = StandIn(lambda n, body: (200, chat_answer(body)))
    batch, out = tmp_path / "f.jsonl", tmp_path / "out"
    batch.write_text("".join(json.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": contract.CHAT_URL,
        "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}) + "\n"
        for i in range(3)))
    script = f"""
import os, sys
from batch_pipeline.cli.main import main
def loaded(code=0):
    print(sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules), code, flush=True)
    real_exit(code)
real_exit, os._exit = os._exit, loaded
loaded(main(["run", {str(batch)!r}, "--output-dir", {str(out)!r}]))
"""
    done = run_beside(server, script)
    assert done.stdout.strip().split("\n")[-1] == "[] 0", done.stdout
    assert [r["custom_id"] for r in read_jsonl(str(out / "output.jsonl"))] == ["c-0", "c-1", "c-2"]
    assert server.posts == 3


def test_a_warm_engine_on_other_weights_keys_its_answers_apart(tmp_path, monkeypatch):
    """The checkpoint identity of a warm run names what the server says it loaded (vLLM's /v1/models
    `root` and `max_model_len` of the served name): restarted on other weights under the same name,
    its answers are keyed apart, so a resumed run never mixes the two models' answers."""
    from batch_pipeline.defs.resources import LLMResource
    from batch_pipeline.io.checkpoints import checkpoint_key

    for var in ("ENGINE_URL", "ENGINE_API_KEY", "MODEL_PATH", "MODELS_FILE", "MODEL_VERSIONS"):
        monkeypatch.delenv(var, raising=False)
    root = {"path": "/models/a"}
    server = StandIn(lambda n, body: None, pages={"/v1/models": lambda: {"object": "list", "data": [
        {"id": TINY_NAME, "object": "model", "root": root["path"], "max_model_len": 2048}]}})
    try:
        def identity() -> dict[str, Any]:
            return LLMResource(engine_url=server.url, served_model_name=TINY_NAME).identity()

        first = identity()
        assert first["server_model"] == "/models/a" and first["server_max_model_len"] == 2048
        root["path"] = "/models/b"
        second = identity()
    finally:
        server.stop()
    assert second["server_model"] == "/models/b"
    assert checkpoint_key("sha", first) != checkpoint_key("sha", second)


def test_a_kept_alive_connection_the_server_closed_is_no_fault_of_the_server():
    """vLLM closes a connection idle for 5 s; a thread that sends on it then gets a reset. That is sent
    again at once on a new connection: no back-off, no 'did not take' line, no wait counted (even with
    ENGINE_WAIT_SECONDS=0, which fails on the first real refusal)."""
    server = StandIn(lambda n, body: (200, chat_answer(body)), idle_close=0.3)
    logged: list[str] = []
    try:
        engines = engines_at(server.url, engine_window=2, engine_wait_seconds=0)
        engines.log = logged.append
        first = list(engines.stream("batch_x", [request(i) for i in range(1, 5)], created=1))
        time.sleep(1.0)  # the scenario itself: the threads' connections sit idle past the server's limit
        second = list(engines.stream("batch_y", [request(i) for i in range(1, 5)], created=1))
    finally:
        server.stop()
    assert len(first) == len(second) == 4 and all(a.kind == "output" for a in first + second)
    assert not [m for m in logged if "did not take" in m], logged
    assert server.posts == 8


def test_one_line_the_server_keeps_failing_is_that_lines_error_not_an_outage():
    """A 500 with an error body for one line (say a tool parser that fails on its output), the other
    lines answered: after 3 tries it is that line's error, and the run goes on."""
    def script(n: int, body: dict[str, Any]) -> tuple[int, Any]:
        if "poison" in body["messages"][-1]["content"]:
            return 500, {"error": {"message": "tool parser failed", "type": "InternalServerError", "code": 500}}
        return 200, chat_answer(body)

    server = StandIn(script)
    try:
        engines = engines_at(server.url, engine_window=2, engine_wait_seconds=2)
        answers = {a.line: a for a in engines.stream("batch_x", [request(1), request(2, "poison"), request(3)], created=1)}
    finally:
        server.stop()
    assert answers[1].kind == answers[3].kind == "output"
    assert answers[2].kind == "error" and answers[2].record["response"]["status_code"] == 500
    assert answers[2].record["response"]["body"]["error"]["message"] == "tool parser failed"
    assert server.posts == 2 + 3


def test_fields_accepted_and_ignored_in_process_are_not_sent(tiny_llm):
    bodies: list[dict[str, Any]] = []
    server = StandIn(lambda n, body: (bodies.append(body), (200, chat_answer(body)))[1])
    try:
        req = request(1, stream_options={"include_usage": True}, user="u-1", metadata={"k": "v"})
        [one] = list(engines_at(server.url).stream("batch_x", [req], created=1))
    finally:
        server.stop()
    assert one.kind == "output" and not {"stream_options", "user", "metadata"} & set(bodies[0]), bodies[0]
    sent = vllm_priority(0, prompts.prefix_rank(req.url, req.body), time.time())
    assert sent - EPOCH_SECONDS * 2**24 <= bodies[0]["priority"] <= sent  # batch priority 0, sent within the last minute
    assert bodies[0]["_request_id"].startswith("req_")


def test_a_server_gone_longer_than_the_wait_fails_naming_its_url():
    server = StandIn(lambda n, body: (503, {"error": {"message": "engine dead"}}))
    try:
        engines = engines_at(server.url, engine_wait_seconds=1.5)
        started = time.monotonic()
        with pytest.raises(EngineUnavailable) as gone:
            list(engines.stream("batch_x", [request(1)], created=1))
    finally:
        server.stop()
    assert server.url in str(gone.value) and "ENGINE_WAIT_SECONDS=1.5" in str(gone.value), gone.value
    assert "next run resumes" in str(gone.value) and 1.5 <= time.monotonic() - started < 15


@pytest.mark.slow
def test_a_hung_server_stops_the_run_a_slow_live_one_is_waited_for(monkeypatch):
    """Connections open but no answer: after STALL_CHECK_SECONDS without one the run asks the server
    for /health. A server silent there too for ENGINE_WAIT_SECONDS (hung) stops the run naming its
    URL, instead of holding it for ANSWER_SECONDS; a long decode on a server whose /health answers
    is waited for."""
    from batch_pipeline.engine import remote

    monkeypatch.setattr(remote, "STALL_CHECK_SECONDS", 0.3)
    monkeypatch.setattr(remote, "SHORT_SECONDS", 0.5)
    gone = threading.Event()
    hung = StandIn(lambda n, body: (gone.wait(30), (200, chat_answer(body)))[1],
                   pages={"/health": lambda: (gone.wait(30), (503, {}))[1]})
    try:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match=f"the warm engine at {hung.url} holds this run's requests .* nor /health"):
            list(engines_at(hung.url, engine_wait_seconds=1.0).stream("batch_x", [request(1), request(2)], created=1))
        assert time.monotonic() - started < 10
    finally:
        gone.set()
        hung.stop()
    slow = StandIn(lambda n, body: (time.sleep(2.0), (200, chat_answer(body)))[1],  # a long decode, the scenario
                   pages={"/health": {}})
    try:
        answers = list(engines_at(slow.url, engine_wait_seconds=1.0).stream("batch_x", [request(1)], created=1))
    finally:
        slow.stop()
    assert [a.kind for a in answers] == ["output"]


def test_a_server_back_within_the_wait_answers_what_was_in_flight():
    """Down at the first tries (connection refused), up again on the same port within ENGINE_WAIT_SECONDS."""
    server = StandIn(lambda n, body: (200, chat_answer(body)))
    port = int(server.url.rsplit(":", 1)[1])
    engines = engines_at(server.url, engine_wait_seconds=60)
    server.stop()  # refused from now on
    back: list[StandIn] = []
    threading.Timer(1.5, lambda: back.append(StandIn(lambda n, body: (200, chat_answer(body)), port=port))).start()
    try:
        answers = list(engines.stream("batch_x", [request(i) for i in range(1, 6)], created=1))
    finally:
        for s in back:
            s.stop()
    assert sorted(a.line for a in answers) == [1, 2, 3, 4, 5] and all(a.kind == "output" for a in answers)
    assert sorted(back[0].answered.values()) == [1] * 5


def test_at_run_start_a_wrong_server_is_refused_naming_the_url_and_its_models():
    with pytest.raises(EngineUnavailable, match=r"http://127\.0\.0\.1:9 does not answer"):
        engines_at("http://127.0.0.1:9")
    other = StandIn(lambda n, body: (200, chat_answer(body)), served=("Llama-3-8B", "other-adapter"))
    try:
        with pytest.raises(ConfigError) as wrong:
            engines_at(other.url)
    finally:
        other.stop()
    assert other.url in str(wrong.value) and "serves Llama-3-8B, other-adapter, not tiny-llama" in str(wrong.value)


# -- the real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """This file's two real servers, started together when the first is needed (their vLLM imports and
    loads overlap; the pooling one waited ~30 s of its own later), not waited for here: "small" on the
    tiny model and "pooling" on the bundled embedding model."""
    from batch_pipeline.config import models
    from batch_pipeline_tests.support.warm_engine import WarmServer

    servers: dict[str, Any] = {}
    try:
        servers["small"] = WarmServer(tiny_model_dir, TINY_NAME, tmp_path_factory.mktemp("small_engine") / "server.log",
                                      batch_size=4, wait=False)
        servers["pooling"] = WarmServer(models.embedding_model_dir(), EMBED_NAME,
                                        tmp_path_factory.mktemp("pooling") / "server.log", runner="pooling", wait=False)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def small_engine(real_servers: dict[str, Any]) -> Any:
    """vLLM's server on the tiny model (as `batch-pipeline engine start` runs it), decoding 4 sequences
    at a time (--max-num-seqs 4) so that requests queue in it; killed and restarted by the last test here."""
    real_servers["small"].wait_healthy()
    return real_servers["small"]




def mixed_lines() -> list[str]:
    """Chat, completions and Responses lines, greedy (temperature 0: the same tokens wherever they run)."""
    lines = []
    for i in range(6):
        chat = {"model": TINY_NAME, "messages": [{"role": "user", "content": f"question {i} about the same topic"}],
                "max_tokens": 6 + i, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat}))
    for i in range(3):
        body = {"model": TINY_NAME, "prompt": f"Once upon a time {i}", "max_tokens": 5, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    # Echoed with logprobs: the prompt's tokens carry logprobs too, as vLLM's server gives them.
    body = {"model": TINY_NAME, "prompt": "The sky over the sea", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 2}
    lines.append(json.dumps({"custom_id": "cmpl-echo", "method": "POST", "url": "/v1/completions", "body": body}))
    body = {"model": TINY_NAME, "input": "Say something", "max_output_tokens": 5, "temperature": 0}
    lines.append(json.dumps({"custom_id": "resp-0", "method": "POST", "url": "/v1/responses", "body": body}))
    long = {"model": TINY_NAME, "messages": [{"role": "user", "content": "word " * (TINY_MAX_MODEL_LEN + 50)}], "max_tokens": 4}
    lines.append(json.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions", "body": long}))
    return lines


def by_id(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["custom_id"]: r for r in records}


def texts(record: dict[str, Any]) -> Any:
    body = record["response"]["body"]
    if body.get("object") == "response":
        return [c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"]], body["status"]
    return [(c.get("message", {}).get("content") if "message" in c else c.get("text"), c["finish_reason"]) for c in body["choices"]]


def test_a_batch_answers_the_same_warm_as_in_process(small_engine, tiny_llm, tmp_path):
    folder = tmp_path / "in" / DATE
    write_batch(folder, "mixed.jsonl", mixed_lines())
    local = materialize(tiny_llm, str(tmp_path / "in"), str(tmp_path / "local"))
    warm_llm = tiny_llm.rebuilt(engine_url=small_engine.url)
    warm = materialize(warm_llm, str(tmp_path / "in"), str(tmp_path / "warm"))
    assert local.success and warm.success
    results = {}
    for name in ("local", "warm"):
        out = tmp_path / name / DATE / "mixed"
        results[name] = (by_id(read_jsonl(str(out / "output.jsonl"))), by_id(read_jsonl(str(out / "errors.jsonl"))))
    (local_out, local_err), (warm_out, warm_err) = results["local"], results["warm"]
    assert sorted(local_out) == sorted(warm_out) and len(warm_out) == 11
    for custom_id, record in local_out.items():
        mine = warm_out[custom_id]
        assert texts(mine) == texts(record), custom_id  # greedy: the same tokens
        assert mine["id"] == record["id"] and mine["response"]["body"]["id"] == record["response"]["body"]["id"]
        usage = (mine["response"]["body"]["usage"], record["response"]["body"]["usage"])
        assert usage[0].get("completion_tokens", usage[0].get("output_tokens")) == \
            usage[1].get("completion_tokens", usage[1].get("output_tokens")), custom_id
    # The echoed completion's logprobs, prompt tokens first, in the server's shape.
    echoed = [record["response"]["body"]["choices"][0]["logprobs"] for record in (local_out["cmpl-echo"],
                                                                                  warm_out["cmpl-echo"])]
    assert echoed[0]["tokens"] == echoed[1]["tokens"] and len(echoed[0]["tokens"]) > 3, echoed
    assert echoed[0]["text_offset"] == echoed[1]["text_offset"] and echoed[0]["text_offset"][0] == 0
    assert echoed[0]["token_logprobs"][0] is None and echoed[1]["token_logprobs"][0] is None
    assert echoed[0]["token_logprobs"][1:] == pytest.approx(echoed[1]["token_logprobs"][1:], abs=0.05)
    # Each token among its own top candidates (their order may differ by a near tie: batches differ).
    assert all(top is None or token in top for lp in echoed for token, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert all("prompt_logprobs" not in c for c in warm_out["cmpl-echo"]["response"]["body"]["choices"])  # vLLM's own
    assert sorted(local_err) == sorted(warm_err) == ["too-long"]
    assert warm_err["too-long"]["error"]["code"] == local_err["too-long"]["error"]["code"] == "context_length_exceeded"
    # The warm run loaded no model: its record says 0 s and names the server.
    info = json.loads((tmp_path / "warm" / DATE / "mixed" / "_work" / "inference.json").read_text())
    assert info["model_load_seconds"] == 0 and small_engine.url in info["engine"]["engine"]
    # Its share of the engine, from the server's own counters: alone on it, (about) all of what it computed.
    assert info["engine_url"] == small_engine.url and 0.9 <= info["engine_token_share"] <= 1.0, info
    assert info["engine_busy_share"] is None or 0 <= info["engine_busy_share"] <= 1, info


def test_a_closed_stream_makes_the_server_abort_what_it_holds(small_engine):
    before = small_engine.metrics()
    engines = engines_at(small_engine.url, engine_window=4)
    # Staggered lengths (ignore_eos: exactly max_tokens each), so the first answer comes while the others run.
    long = [request(i, f"tell a long story {i}", max_tokens=60 + 50 * i, ignore_eos=True) for i in range(1, 9)]
    stream = engines.stream("batch_x", long, created=1)
    first = next(stream)  # the window (4) sent in order; the first answer back
    assert first.kind == "output"
    assert small_engine.metrics().get("vllm:num_requests_running", 0.0) >= 1  # the server holds the other three
    stream.close()  # a cancel: the connections in flight are closed

    def idle() -> bool:
        return small_engine.metrics().get("vllm:num_requests_running", 1.0) == 0.0

    wait_for("the server holding no request", idle, 30, interval=0.5,
             on_timeout=lambda: f"requests running: {small_engine.metrics().get('vllm:num_requests_running')}")
    generated = small_engine.metrics()["vllm:generation_tokens_total"]
    time.sleep(2)  # a measuring window: nothing is generated in it
    after = small_engine.metrics()
    assert after["vllm:generation_tokens_total"] == generated  # it stopped generating for them
    # Only the first request finished (vLLM counts a finished request by its reason; the three aborted
    # ones are not among them, whenever the abort came): without the abort all four would be.
    finished = after.get("vllm:request_success_total", 0.0) - before.get("vllm:request_success_total", 0.0)
    assert finished == 1, finished


def test_a_completion_of_several_prompts_counts_every_prompts_cached_tokens(small_engine):
    """vLLM's server counts the cached tokens of a request's last prompt only; the pipeline sends a line
    of several prompts as one request per prompt, so its usage counts every prompt's, as in-process."""
    engines = engines_at(small_engine.url)
    # Over two of the CPU build's 128-token blocks (only whole blocks are cached), within MAX_MODEL_LEN.
    text = "A long opening that every prompt of this test shares, word for word, " * 10
    list_body = {"model": TINY_NAME, "prompt": [text, text, text], "max_tokens": 3, "temperature": 0}

    def answer(req: contract.BatchRequest) -> Any:
        [got] = list(engines.stream("batch_cached", [req], created=1))
        assert got.kind == "output", got.record
        return got

    answer(request(1, text, url=contract.COMPLETIONS_URL, temperature=0, max_tokens=3))  # now in the prefix cache
    one = answer(request(2, text, url=contract.COMPLETIONS_URL, temperature=0, max_tokens=3))
    three = answer(contract.BatchRequest(line=3, custom_id="c-3", url=contract.COMPLETIONS_URL, body=list_body))
    assert one.cached_tokens >= 128 and three.cached_tokens == 3 * one.cached_tokens, (one.cached_tokens, three.cached_tokens)
    body = three.record["response"]["body"]
    assert three.prompt_tokens == 3 * one.prompt_tokens and body["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        three.cached_tokens
    single = one.record["response"]["body"]["choices"][0]["text"]
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, single), (1, single), (2, single)]  # greedy
    engines.close()


def timed(stream: Any) -> list[tuple[float, Any]]:
    return [(time.monotonic(), answer) for answer in stream]


@pytest.mark.parametrize("urgent_priority", [0, 10], ids=["same priority", "urgent"])
def test_an_urgent_batch_overtakes_a_bulk_one_on_one_engine(small_engine, urgent_priority, monkeypatch):
    """A bulk batch keeps 8 long requests on a server that decodes 4 at a time; a short batch comes
    while it runs. At the bulk's priority, sent in a later epoch than the bulk's waiting requests, it
    queues behind them (more bulk answers come while it is answered than the 4 running); with a
    higher one its requests go ahead of the waiting bulk ones and wait only for the 4 running (at
    most 4 bulk answers). (Epochs are made milliseconds here, so "later" needs no minute's wait;
    within one epoch, equal priorities go by prompt prefix: test_a_requests_vllm_priority_...)"""
    from batch_pipeline.engine import remote

    monkeypatch.setattr(remote, "EPOCH_SECONDS", 0.001)

    def no_local() -> Any:
        raise AssertionError("nothing here is for an in-process engine")

    settings = EngineSettings(engine_url=small_engine.url, engine_window=8)
    bulk = RemoteEngines(settings, TINY_NAME, no_local, priority=0)
    urgent = RemoteEngines(dataclasses.replace(settings, engine_window=4), TINY_NAME, no_local, priority=urgent_priority)
    # Equal lengths (ignore_eos): the bulk requests finish 4 at a time, in waves.
    # 400 tokens: a wave lasts long enough that a loaded machine (load 12 in CI) cannot let a second
    # wave finish between the test taking the first answers and the urgent batch reaching the server.
    bulk_requests = [request(i, f"bulk {i}", max_tokens=400, ignore_eos=True) for i in range(1, 21)]
    urgent_requests = [request(100 + i, f"urgent {i}", max_tokens=5, ignore_eos=True) for i in range(4)]
    stream = bulk.stream("bulk", bulk_requests, created=1)
    # The first wave's 4 answers: the server now decodes the second wave and holds 4 more waiting.
    bulk_answers = [(time.monotonic(), next(stream)) for _ in range(4)]
    rest = threading.Thread(target=lambda: bulk_answers.extend(timed(stream)))
    rest.start()
    # The window refills as answers come back: the 4 next bulk requests must be at the server (in an
    # earlier epoch) before the short batch is sent. Sent right after the 4th answer, a loaded machine
    # once let the short batch arrive first (CI: 4 bulk answers during it at the same priority).
    wait_for("the bulk's next 4 requests waiting at the server",
             lambda: small_engine.metrics().get("vllm:num_requests_waiting", 0.0) >= 4, 60, interval=0.05,
             on_timeout=lambda: f"waiting: {small_engine.metrics().get('vllm:num_requests_waiting')}")
    began = time.monotonic()
    urgent_answers = timed(urgent.stream("urgent", urgent_requests, created=1))
    ended = time.monotonic()
    rest.join(300)
    assert not rest.is_alive() and sorted(a.line for _, a in bulk_answers) == list(range(1, 21))
    assert sorted(a.line for _, a in urgent_answers) == [100, 101, 102, 103]
    during = sum(1 for t, _ in bulk_answers if began <= t <= ended)
    if urgent_priority:
        assert during <= 4, (during, ended - began)  # only those running when it came
    else:
        assert during > 4, (during, ended - began)  # also bulk requests that were waiting when it came


def test_a_server_killed_and_restarted_mid_stream_loses_no_line_and_doubles_none(small_engine):
    """The server SIGKILLed while it holds requests and started again on the same port: the requests
    in flight are sent again once it is back, and every line is answered exactly once."""
    def no_local() -> Any:
        raise AssertionError("nothing here is for an in-process engine")

    engines = RemoteEngines(EngineSettings(engine_url=small_engine.url, engine_window=8, engine_wait_seconds=300),
                            TINY_NAME, no_local)
    logged: list[str] = []
    engines.log = logged.append
    stream = engines.stream("batch_x", [request(i, f"line {i}", max_tokens=40, ignore_eos=True) for i in range(1, 31)],
                            created=1)
    answers = [next(stream) for _ in range(3)]
    small_engine.kill()  # 8 requests in flight: 4 decoding, 4 waiting
    restart = threading.Thread(target=small_engine.start)
    restart.start()
    answers += list(stream)
    restart.join(300)
    lines = [a.line for a in answers]
    assert sorted(lines) == list(range(1, 31)) and len(set(lines)) == 30  # each once
    assert all(a.kind == "output" and a.completion_tokens == 40 for a in answers)
    assert any("sending it again as it comes back" in m for m in logged), logged
    assert small_engine.started_at > 0 and small_engine.healthy()


# -- the pooling models on a warm engine of their own ---------------------------------------------


@pytest.fixture(scope="module")
def pooling_engine(real_servers: dict[str, Any]) -> Any:
    """vLLM's server on the bundled all-MiniLM-L6-v2 (`batch-pipeline engine start --runner pooling`)."""
    real_servers["pooling"].wait_healthy()
    return real_servers["pooling"]


def pooling_lines() -> list[str]:
    def line(custom_id: str, url: str, **body: Any) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": EMBED_NAME, **body}})

    return [line("e-1", contract.EMBEDDINGS_URL, input="The food was delicious."),
            line("e-2", contract.EMBEDDINGS_URL, input=["hello", "world"]),
            line("e-3", contract.EMBEDDINGS_URL, input="base64, please", encoding_format="base64"),
            line("s-1", contract.SCORE_URL, queries="capital of France?", documents=["Paris", "Bananas"]),
            line("s-2", contract.SCORE_URL, text_1="a cat", text_2="a kitten"),
            line("r-1", contract.RERANK_URL, query="capital of France?", documents=["Bananas", "Paris", "Rome"], top_n=2),
            line("r-2", contract.RERANK_URL, query="a cat", documents=["a kitten", "a car"], return_documents=True),
            json.dumps({"custom_id": "chat-1", "method": "POST", "url": contract.CHAT_URL,  # stays in this process
                        "body": {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "temperature": 0}})]


def test_embeddings_score_and_rerank_answer_the_same_on_a_pooling_warm_engine(pooling_engine, tiny_llm, tmp_path):
    """EMBEDDING_ENGINE_URL: the embedding model's embeddings, score and rerank lines go to its warm
    engine and give the in-process result lines (ids, shapes, token counts; vectors and scores equal to
    float precision); the chat line of the same file is answered in this process."""
    write_batch(tmp_path / "in" / DATE, "pooled.jsonl", pooling_lines())
    local = materialize(tiny_llm, str(tmp_path / "in"), str(tmp_path / "local"))
    warm = materialize(tiny_llm.rebuilt(embedding_engine_url=pooling_engine.url), str(tmp_path / "in"),
                       str(tmp_path / "warm"))
    assert local.success and warm.success
    served = pooling_engine.metrics()
    outs = {name: by_id(read_jsonl(str(tmp_path / name / DATE / "pooled" / "output.jsonl"))) for name in ("local", "warm")}
    assert sorted(outs["local"]) == sorted(outs["warm"]) and len(outs["warm"]) == 8
    for custom_id, record in outs["local"].items():
        mine = outs["warm"][custom_id]
        assert mine["id"] == record["id"] and mine["response"]["status_code"] == 200, (custom_id, mine)
        body, theirs = mine["response"]["body"], record["response"]["body"]
        assert sorted(body) == sorted(theirs), custom_id  # the same fields
        assert body.get("id") == theirs.get("id") and sorted(body["usage"]) == sorted(theirs["usage"]), custom_id
        if custom_id.startswith("e-"):
            assert body["usage"] == theirs["usage"], (custom_id, body["usage"], theirs["usage"])
        else:  # score and rerank on an embedding model: the server counts the query once, as it encodes it;
            # LLM.score in this process counts it again in every pair (docs/ENGINE.md)
            assert 0 < body["usage"]["prompt_tokens"] <= theirs["usage"]["prompt_tokens"], (custom_id, body, theirs)
        if custom_id.startswith("e-") and custom_id != "e-3":
            for a, b in zip(body["data"], theirs["data"], strict=True):
                assert a["index"] == b["index"] and a["embedding"] == pytest.approx(b["embedding"], abs=1e-4)
        elif custom_id == "e-3":
            assert isinstance(body["data"][0]["embedding"], str)  # base64, as asked
        elif custom_id.startswith("s-"):
            assert [d["score"] for d in body["data"]] == pytest.approx([d["score"] for d in theirs["data"]], abs=1e-4)
        elif custom_id.startswith("r-"):
            assert [(r["index"], r["document"]) for r in body["results"]] == \
                [(r["index"], r["document"]) for r in theirs["results"]], custom_id
            assert [r["relevance_score"] for r in body["results"]] == \
                pytest.approx([r["relevance_score"] for r in theirs["results"]], abs=1e-4)
    info = json.loads((tmp_path / "warm" / DATE / "pooled" / "_work" / "inference.json").read_text())
    assert pooling_engine.url in json.dumps(info), info  # the run says which server answered
    # The server answered the pooling lines (7 requests), not the chat line.
    assert served.get("vllm:request_success_total", 0) >= 7, served

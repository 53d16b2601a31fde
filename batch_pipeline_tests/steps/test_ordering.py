"""ORDER=planned (steps/ordering.py): the plan itself (prefix groups contiguous, long decodes first,
keys from the chat template or the request text), its memory at 1M lines, records read back in
plan order from a local copy (a work file on S3), and the setting. No engine here except the tiny
model's tokenizer; that the order changes nothing a user sees is tested on real runs in
test_ordering_runs.py.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from batch_pipeline.contract import prompts
from batch_pipeline.steps import ordering
from batch_pipeline.config.settings import ConfigError, EngineSettings, engine_settings_from_env

CHAT = "/v1/chat/completions"


def record(line: int, body: dict, url: str = CHAT) -> bytes:
    return (json.dumps({"line": line, "request": {"custom_id": f"r-{line}", "url": url, "body": body}}) + "\n").encode()


def docs_and_questions(docs: int, questions: int, seed: int = 7) -> list[dict]:
    """`docs` documents x `questions` questions each, as chat bodies, shuffled."""
    rng = random.Random(seed)
    bodies = []
    for d in range(docs):
        text = f"Document {d}. " + " ".join(f"w{(d * 31 + i) % 97}" for i in range(120))
        for q in range(questions):
            bodies.append({"messages": [{"role": "system", "content": "Answer from the document."},
                                        {"role": "user", "content": f"{text}\nQuestion {q}?"}],
                           "max_tokens": rng.choice([8, 32, 128]), "doc": d})
    rng.shuffle(bodies)
    return bodies


def plan_of(bodies: list[dict], render=None, **options) -> list[int]:
    """The plan's order of `bodies`, as their indexes."""
    raws = [record(i, body) for i, body in enumerate(bodies)]
    offsets = list(itertools.accumulate((len(r) for r in raws), initial=0))[:-1]
    plan = ordering.make_plan(zip(offsets, raws), len(raws), None, render, **options)
    try:
        return [json.loads(raw)["line"] for raw in plan.records()]
    finally:
        plan.close()


def test_requests_sharing_a_document_are_fed_together_longest_decode_first():
    bodies = docs_and_questions(docs=6, questions=5)
    order = plan_of(bodies)
    assert sorted(order) == list(range(len(bodies)))  # each request once
    docs = [bodies[i]["doc"] for i in order]
    runs = [doc for doc, _ in itertools.groupby(docs)]
    assert sorted(runs) == list(range(6)), f"a document's questions are split: {docs}"
    for doc in range(6):  # within a document, long decodes first
        limits = [bodies[i]["max_tokens"] for i in order if bodies[i]["doc"] == doc]
        assert limits == sorted(limits, reverse=True), limits
    # Documents holding a 128-token decode come before those whose longest is shorter.
    longest = [max(b["max_tokens"] for b in bodies if b["doc"] == doc) for doc in runs]
    assert longest == sorted(longest, reverse=True), longest


def test_distinct_prompts_behind_one_system_prompt_go_longest_decode_first():
    # Every line shares the system prompt (one group at the first levels): decode length decides.
    rng = random.Random(3)
    bodies = [{"messages": [{"role": "system", "content": "You are a careful assistant. " * 8},
                            {"role": "user", "content": f"Tell me about item {i}."}],
               "max_tokens": rng.randint(8, 256), "ignore_eos": True} for i in range(64)]
    order = plan_of(bodies)
    limits = [bodies[i]["max_tokens"] for i in order]
    assert limits == sorted(limits, reverse=True)


def test_a_group_is_contiguous_even_when_another_has_the_same_longest_decode():
    # Two documents, each with a 64-token and an 8-token question: ties on the longest decode must
    # not interleave the groups (A64, B64, A8, B8 would split both).
    bodies = [{"messages": [{"role": "user", "content": f"{'A' if d == 0 else 'B'} " * 300 + f"q{t}"}],
               "max_tokens": t, "doc": d} for d in (0, 1) for t in (64, 8)]
    docs = [bodies[i]["doc"] for i in plan_of(bodies)]
    assert docs in ([0, 0, 1, 1], [1, 1, 0, 0]), docs


def test_decode_estimates_come_from_the_line():
    assert ordering.expected_decode(CHAT, {"max_tokens": 40, "n": 3}) == 120
    assert ordering.expected_decode(CHAT, {"max_completion_tokens": 7, "max_tokens": 40}) == 7
    assert ordering.expected_decode(CHAT, {}) == ordering.UNBOUNDED_DECODE  # may run to the context
    assert ordering.expected_decode("/v1/completions", {"prompt": "x"}) == 16  # OpenAI's legacy default
    assert ordering.expected_decode("/v1/responses", {"input": "x", "max_output_tokens": 9}) == 9
    assert ordering.expected_decode("/v1/embeddings", {"input": "x"}) == 0
    assert ordering.expected_decode(CHAT, {"max_tokens": "many"}) == ordering.UNBOUNDED_DECODE


def test_keys_from_the_chat_template_group_as_the_request_text_does(tiny_model_dir):
    ordering.chat_template_renderer.cache_clear()
    render, keyed_on = ordering.chat_template_renderer(str(tiny_model_dir))
    assert render is not None and keyed_on.startswith("the chat template of ")
    bodies = docs_and_questions(docs=4, questions=3)
    text = render(prompts.chat_messages(bodies[0]), None)
    assert "Answer from the document." in text and text != prompts.prompt_text(CHAT, bodies[0])  # rendered
    with_template = [bodies[i]["doc"] for i in plan_of(bodies, render)]
    assert len([d for d, _ in itertools.groupby(with_template)]) == 4, with_template


def test_a_folder_without_a_tokenizer_falls_back_to_the_request_text(tmp_path):
    render, keyed_on = ordering.chat_template_renderer(str(tmp_path))
    assert render is None and keyed_on.startswith("request text (the model's tokenizer did not load")


def test_a_line_the_template_refuses_still_gets_a_key():
    def refuse(messages, tools):
        raise ValueError("template error")

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompts.prompt_text(CHAT, body, refuse) == prompts.prompt_text(CHAT, body)


def test_records_are_read_back_from_a_local_copy_in_plan_order(tmp_path):
    bodies = docs_and_questions(docs=3, questions=4)
    raws = [record(i, body) for i, body in enumerate(bodies)]
    plan = ordering.make_plan(((0, raw) for raw in raws), len(raws), None, temp_dir=str(tmp_path))
    (copy,) = plan.sources
    assert copy.startswith(str(tmp_path)) and sorted(plan.records()) == sorted(raws)
    # 3 documents in the first block, 12 distinct prompts in all: what the run's log says.
    assert plan.groups[0] == 3 and plan.groups[-1] == 12
    assert plan.describe_groups() == "prefix groups at 64/256/1024/4096/16384/65536 characters: 3/3/12/12/12/12"
    plan.close()
    assert not list(tmp_path.iterdir())  # the copy and its folder are gone


def test_keys_spilled_to_disk_give_the_same_plan():
    bodies = docs_and_questions(docs=5, questions=4)
    assert plan_of(bodies, memory_bytes=1) == plan_of(bodies)


def test_more_records_than_announced_are_refused():
    with pytest.raises(ValueError, match="more requests than the 1 expected"):
        ordering.make_plan(((0, record(i, {"messages": []})) for i in range(2)), 1, None)


@pytest.mark.slow
def test_the_planner_holds_a_million_lines_in_little_memory():
    """1M chat lines planned in a fresh process: its peak memory grows by the keys (~40 bytes a
    line) and the sort, not by the prompts (about 200 MB of records pass through)."""
    script = textwrap.dedent("""
        import json, time
        from batch_pipeline.steps import ordering
        def peak_mb():  # VmHWM: this process's peak resident memory (ru_maxrss may be the parent's after exec)
            status = open("/proc/self/status").read()
            return int(status.split("VmHWM:")[1].split()[0]) / 1024
        N = 1_000_000
        HEAD = '{"line":%d,"request":{"custom_id":"r%d","url":"/v1/chat/completions","body":{"messages":'
        BODY = '[{"role":"system","content":"You are terse."},{"role":"user","content":"doc %d: %s question %d"}],"max_tokens":%d}}}'
        PAD = "lorem ipsum " * 8
        def records():
            offset = 0
            for i in range(N):
                raw = (HEAD % (i + 1, i) + BODY % (i % 5000, PAD, i, 8 + i % 200) + "\\n").encode()
                yield offset, raw
                offset += len(raw)
        before = peak_mb()
        started = time.perf_counter()
        plan = ordering.make_plan(records(), N, "/nonexistent/requests.jsonl")
        seconds = time.perf_counter() - started
        grown = peak_mb() - before
        first = [int(plan.order[i]) for i in range(3)]
        print(json.dumps({"grown_mb": grown, "seconds": seconds, "planned": len(plan), "groups": plan.groups, "first": first}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"planner at 1M lines: {figures}")  # shown with -s; the bench prints planning time too
    assert figures["planned"] == 1_000_000 and figures["groups"][0] == 5000  # the first block names the document
    assert figures["groups"][-1] == 1_000_000  # and each whole prompt is its own
    # The longest decode (207 tokens: i % 200 == 199) leads.
    assert all((i % 200) == 199 for i in figures["first"]), figures["first"]
    assert figures["grown_mb"] < 160, f"planning 1M lines grew the process by {figures['grown_mb']:.0f} MB"


def test_order_is_a_setting_named_in_its_error():
    assert EngineSettings().order == "planned"
    assert engine_settings_from_env({"ORDER": "input"}).order == "input"
    with pytest.raises(ConfigError, match="ORDER='random' is not one of input, planned"):
        engine_settings_from_env({"ORDER": "random"})


def test_order_is_in_the_launchpad():
    from batch_pipeline.defs.resources import LLMResource

    field = LLMResource.model_fields["order"]
    assert field.description.startswith("ORDER:")
    with pytest.raises(ConfigError, match="ORDER="):
        LLMResource(order="fastest").settings()
    assert LLMResource(order="input").settings().order == "input"


def test_the_plan_of_nothing_is_empty():
    assert len(ordering.planned_order(np.zeros(0, dtype=ordering.KEY_DTYPE))) == 0
    plan = ordering.make_plan(iter(()), 0, None)
    assert len(plan) == 0 and list(plan.records()) == []
    plan.close()


def test_prefix_caching_is_on_unless_set_off(tmp_path):
    from batch_pipeline.engine.engine_args import engine_kwargs

    assert engine_kwargs(EngineSettings(), str(tmp_path), "m", "generate")["enable_prefix_caching"] is True
    off = engine_settings_from_env({"ENABLE_PREFIX_CACHING": "false"})
    assert engine_kwargs(off, str(tmp_path), "m", "generate")["enable_prefix_caching"] is False


class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


class _FakeRank:
    """What _Feeder reads and writes of a rank: its pipe, its wants and what it holds."""

    def __init__(self):
        from collections import deque

        self.conn, self.wants, self.outstanding = _Conn(), deque(), 0


def test_data_parallel_ranks_get_whole_prefix_groups_where_they_can():
    from batch_pipeline.engine.ranks import _Feeder

    # 6 documents x 6 questions, planned; ranks ask for 16 at a time (ranks.WANT).
    bodies = docs_and_questions(docs=6, questions=6)
    raws = [record(i, body) for i, body in enumerate(bodies)]
    plan = ordering.make_plan(((0, raw) for raw in raws), len(raws), None)
    stream = plan.stream(lambda raw, _batch: json.loads(raw)["line"])
    ranks = [_FakeRank(), _FakeRank()]
    feeder = _Feeder(stream, None, len(ranks))
    while not feeder.exhausted:
        for rank in ranks:
            rank.wants.append(16)
        feeder.serve(ranks)
    plan.close()
    replies = [message[1] for rank in ranks for message in rank.conn.sent if message[0] == "requests"]
    assert sorted(line for reply in replies for line in reply) == list(range(36))  # each request once
    chunks = [[bodies[i]["doc"] for i in reply] for reply in replies]
    assert all(8 <= len(chunk) <= 16 for chunk in chunks[:-1]), [len(c) for c in chunks]
    # No document is split across two replies (so across ranks): every cut fell between documents.
    owners = {}
    for n, chunk in enumerate(chunks):
        for doc in chunk:
            owners.setdefault(doc, set()).add(n)
    assert all(len(replies) == 1 for replies in owners.values()), chunks


def test_without_a_plan_the_feeder_hands_out_what_is_asked():
    from batch_pipeline.engine.ranks import _Feeder

    rank = _FakeRank()
    rank.wants.extend([5, 5])
    _Feeder(iter(range(7)), None, 1).serve([rank])
    assert rank.conn.sent == [("requests", [0, 1, 2, 3, 4]), ("requests", [5, 6])]


def test_one_plan_over_several_batches_puts_their_shared_prefixes_together(tmp_path):
    # Three files of a date asking about the same documents; the first is local, the others are
    # read as a remote work file would be (copied locally as they are keyed).
    bodies = docs_and_questions(docs=4, questions=6)
    files = [bodies[0:8], bodies[8:16], bodies[16:24]]
    local = tmp_path / "requests.jsonl"
    raws = [record(i, body) for i, body in enumerate(files[0])]
    local.write_bytes(b"".join(raws))
    offsets = list(itertools.accumulate((len(r) for r in raws), initial=0))[:-1]
    parts = [ordering.PlanPart(zip(offsets, raws), len(raws), str(local))]
    parts += [ordering.PlanPart(((0, record(i, body)) for i, body in enumerate(f)), len(f), None) for f in files[1:]]
    plan = ordering.make_joint_plan(parts)
    try:
        assert plan.sources[0] == str(local) and plan.sources[1] == plan.sources[2] != str(local)
        entries = [(part, json.loads(raw)["line"]) for part, raw in plan.entries()]
    finally:
        plan.close()
    assert sorted(entries) == [(p, line) for p, f in enumerate(files) for line in range(len(f))]  # each once
    docs = [files[part][line]["doc"] for part, line in entries]
    assert [doc for doc, _ in itertools.groupby(docs)] == sorted(set(docs), key=docs.index)  # a document's lines together
    # ... across files: some document's run holds lines of more than one file.
    assert any(len({p for (p, _), d in zip(entries, docs) if d == doc}) > 1 for doc in set(docs))
    assert plan.groups[0] == 4 and len(plan) == 24

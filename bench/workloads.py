"""The benchmarks' workloads: batch files in the OpenAI Batch format (`/v1/chat/completions`, greedy
`temperature: 0`) on the bundled SmolLM2 model: chat questions, random tokens, a shared prefix, documents
x questions, mixed lengths (run_bench.py's --workload), the short "Summarise in one sentence" lines of the
warm-engine benchmarks, and a date of several files (date_files.py, date_files_runs.py).

Not a benchmark: the scripts in bench/ import it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from common import child_env, preflight

CHAT_URL = "/v1/chat/completions"

COUNTRIES = (
    "France Germany Italy Spain Portugal Japan Brazil Canada Kenya Egypt Norway Chile Peru India "
    "Vietnam Mexico Greece Poland Turkey Australia Argentina Sweden Ireland Morocco Nepal Cuba"
).split()
CONCEPTS = (
    "photosynthesis|gravity|inflation|recursion|entropy|democracy|a black hole|the water cycle|"
    "machine learning|compound interest|plate tectonics|a vaccine|the immune system|supply and demand|"
    "electricity|a rainbow|evolution|an eclipse|a blockchain|the internet|a volcano|the moon's phases"
).split("|")
ANIMALS = "cats dogs owls dolphins bees elephants penguins octopuses wolves horses frogs eagles".split()
THINGS = "the sea|autumn|a city at night|coffee|mountains|the first snow|a train journey|friendship|rain".split("|")
TASKS = (
    "boil an egg|learn a new language|fall asleep faster|write a good email|save money|start running|"
    "grow tomatoes|prepare for an interview|keep a plant alive|organize my desk|make bread"
).split("|")
PHRASES = "good morning|thank you very much|where is the station|I like books|see you tomorrow|the weather is nice".split("|")
TEMPLATES = (
    "What is the capital of {country}?",
    "Explain {concept} in one sentence.",
    "Name three facts about {animal}.",
    "What is {a} plus {b}?",
    "Write a short poem about {thing}.",
    "How do I {task}?",
    "Translate '{phrase}' into French.",
    "Give me one tip to {task}.",
    "Why do {animal} matter for the environment?",
    "Describe {country} in two sentences.",
    "What is the difference between {concept} and {concept2}?",
    "Tell a child what {concept} is.",
)


def chat_question(rng: random.Random) -> str:
    return rng.choice(TEMPLATES).format(
        country=rng.choice(COUNTRIES),
        concept=rng.choice(CONCEPTS),
        concept2=rng.choice(CONCEPTS),
        animal=rng.choice(ANIMALS),
        thing=rng.choice(THINGS),
        task=rng.choice(TASKS),
        phrase=rng.choice(PHRASES),
        a=rng.randint(2, 999),
        b=rng.randint(2, 999),
    )


def tokenizer(model_path: str) -> Any:
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))


def random_prompt(tok: Any, rng: random.Random, length: int, special: set[int], vocab: int) -> str:
    """Random tokens, decoded, re-encoded and cut to `length` tokens (as vLLM's benchmark RandomDataset)."""
    ids = [rng.randrange(vocab) for _ in range(length + 8)]
    ids = [i for i in ids if i not in special]
    text = tok.decode(ids, skip_special_tokens=True)
    again = tok.encode(text, add_special_tokens=False).ids[:length]
    return tok.decode(again, skip_special_tokens=True)


def handbook_prefix(tok: Any, length: int) -> str:
    """A long, deterministic system prompt of about `length` tokens."""
    rng = random.Random(1234)
    parts = ["You are the support assistant of the Northwind Travel Company. Follow the handbook below."]
    n = 1
    while len(tok.encode(" ".join(parts), add_special_tokens=False).ids) < length:
        parts.append(
            f"Rule {n}: when a customer asks about {rng.choice(TASKS)} while visiting {rng.choice(COUNTRIES)}, "
            f"explain {rng.choice(CONCEPTS)} politely, mention {rng.choice(THINGS)}, and never promise refunds."
        )
        n += 1
    ids = tok.encode(" ".join(parts), add_special_tokens=False).ids[:length]
    return tok.decode(ids, skip_special_tokens=True)


DOC_SYSTEM = (
    "You are a careful analyst of the Northwind archive. Answer the user's question about the document "
    "they give you in one short sentence, using only that document."
)
DOC_DEPARTMENTS = "logistics|finance|research|customer care|safety|training|procurement|legal|marketing".split("|")
DOC_PEOPLE = "Ana Ortiz|Ben Clarke|Chen Wei|Dara Nwosu|Eli Haddad|Fatima Rossi|Gus Berg|Hana Sato|Ivo Novak".split("|")
DOC_QUESTIONS = (
    "What is the main topic of this document?",
    "Summarize the document in one sentence.",
    "Which country does the document mention first?",
    "Who is the first person named in the document?",
    "What does the document say about {concept}?",
    "Does the document mention {animal}? Answer yes or no.",
    "Which department appears most often in the document?",
    "What happened in {year} according to the document?",
    "List two numbers the document reports.",
    "What is the tone of this report?",
    "Which task does the document say became more expensive?",
    "Give the title of the document.",
    "Does the document recommend {task}? Answer briefly.",
    "What would a reader remember about {country} from this document?",
)


def document_text(tok: Any, rng: random.Random, doc_no: int, length: int) -> str:
    """A synthetic report of about `length` tokens; its first words differ from every other document's."""
    parts = [f"Report {doc_no + 1}: {rng.choice(CONCEPTS)} in {rng.choice(COUNTRIES)} ({rng.randint(1990, 2025)})."]
    while len(tok.encode(" ".join(parts), add_special_tokens=False).ids) < length:
        kind = rng.randrange(4)
        if kind == 0:
            parts.append(
                f"In {rng.randint(1990, 2025)}, the {rng.choice(DOC_DEPARTMENTS)} office in {rng.choice(COUNTRIES)} "
                f"recorded {rng.randint(3, 9000)} cases linked to {rng.choice(CONCEPTS)}, "
                f"{rng.choice(('more', 'fewer', 'about as many'))} than the year before."
            )
        elif kind == 1:
            parts.append(
                f"{rng.choice(DOC_PEOPLE)} of the {rng.choice(DOC_DEPARTMENTS)} team argued that {rng.choice(CONCEPTS)} "
                f"explains why {rng.choice(ANIMALS)} avoid {rng.choice(THINGS)}."
            )
        elif kind == 2:
            parts.append(
                f"The budget to {rng.choice(TASKS)} rose to {rng.randint(2, 950)} thousand euros, while the staff "
                f"of the {rng.choice(DOC_DEPARTMENTS)} office fell by {rng.randint(1, 40)} percent."
            )
        else:
            parts.append(
                f"Visitors from {rng.choice(COUNTRIES)} described {rng.choice(THINGS)} as the reason they return, "
                f"and {rng.randint(2, 98)} percent of them asked how to {rng.choice(TASKS)}."
            )
    ids = tok.encode(" ".join(parts), add_special_tokens=False).ids[:length]
    return tok.decode(ids, skip_special_tokens=True)


def doc_questions(rng: random.Random, count: int) -> list[str]:
    """`count` different questions about one document (templates without repeats while they last)."""
    out: list[str] = []
    while len(out) < count:
        for template in rng.sample(DOC_QUESTIONS, len(DOC_QUESTIONS)):
            q = template.format(concept=rng.choice(CONCEPTS), animal=rng.choice(ANIMALS), year=rng.randint(1990, 2025),
                                task=rng.choice(TASKS), country=rng.choice(COUNTRIES))
            if q not in out:
                out.append(q)
            if len(out) == count:
                break
    return out




def docs_question_bodies(tok: Any, served: str, seed: int, num_docs: int, per_doc: int, doc_len: int,
                         output_len: int) -> list[dict[str, Any]]:
    """`num_docs` documents x `per_doc` questions: a line = the system prompt + one document + one question,
    shuffled (`seed`) so the lines sharing a document are spread over the file."""
    bodies = []
    for d in range(num_docs):
        doc = document_text(tok, random.Random(f"{seed}-doc-{d}"), d, doc_len)
        for q in doc_questions(random.Random(f"{seed}-questions-{d}"), per_doc):
            bodies.append({
                "model": served, "max_tokens": output_len, "temperature": 0,
                "messages": [{"role": "system", "content": DOC_SYSTEM},
                             {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q}"}],
            })
    random.Random(seed).shuffle(bodies)
    return bodies


def make_workload(args: argparse.Namespace, served: str, model_path: str, out: Path) -> dict[str, Any]:
    """Write the workload file `out`; return what describes it (lines, bytes, sizes)."""
    kind = args.workload
    rng = random.Random(args.seed)
    bodies: list[dict[str, Any]] = []
    tok = special = None
    prefix = ""
    info: dict[str, Any] = {}
    if kind in ("random", "shared-prefix", "docs-questions"):
        tok = tokenizer(model_path)
        special = set(tok.get_added_tokens_decoder())
    if kind == "shared-prefix":
        prefix = handbook_prefix(tok, args.prefix_len)
        info["prefix_tokens"] = len(tok.encode(prefix, add_special_tokens=False).ids)
    if kind == "docs-questions":
        # N documents x Q questions; a line = the system prompt + one document + one question. The
        # lines are shuffled (--seed): the lines sharing a document are spread over the file.
        num_docs, per_doc = args.num_docs, args.questions_per_doc
        bodies = docs_question_bodies(tok, served, args.seed, num_docs, per_doc, args.doc_len, args.output_len)
        info.update(num_docs=num_docs, questions_per_doc=per_doc,
                    doc_tokens=len(tok.encode(document_text(tok, random.Random(f"{args.seed}-doc-0"), 0, args.doc_len),
                                              add_special_tokens=False).ids))
    elif kind == "mixed-lengths":
        # Distinct prompts; max_tokens uniform in [min, max] with ignore_eos, so every line makes
        # exactly its max_tokens; as in a real batch file, the lengths come in random order.
        low, high = min(args.min_output_len, args.output_len), args.output_len
        seen: set[str] = set()
        while len(bodies) < args.num_requests:
            question = chat_question(rng)
            if question in seen:
                continue
            seen.add(question)
            bodies.append({"model": served, "max_tokens": rng.randint(low, high), "temperature": 0,
                           "ignore_eos": True, "messages": [{"role": "user", "content": question}]})
        info.update(min_output_len=low, max_output_len=high,
                    max_tokens_sum=sum(b["max_tokens"] for b in bodies))
    else:
        for _ in range(args.num_requests):
            body: dict[str, Any] = {"model": served, "max_tokens": args.output_len, "temperature": 0}
            if kind == "chat":
                body["messages"] = [{"role": "user", "content": chat_question(rng)}]
            elif kind == "random":
                body["messages"] = [
                    {"role": "user", "content": random_prompt(tok, rng, args.input_len, special, tok.get_vocab_size())}
                ]
                body["ignore_eos"] = True  # a vLLM extension; every system passes it to SamplingParams
            else:
                body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": chat_question(rng)}]
            bodies.append(body)
    lines = [
        json.dumps({"custom_id": f"req-{i:06d}", "method": "POST", "url": CHAT_URL, "body": body},
                   ensure_ascii=False)
        for i, body in enumerate(bodies)
    ]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"file": str(out), "lines": len(lines), "bytes": out.stat().st_size, **info}


def prepare_chat_workload(args: argparse.Namespace, work: Path) -> tuple[dict[str, str], dict[str, Any], Path, str]:
    """For the scripts that run `batch-pipeline run` alone (kill_resume.py, data_parallel.py): the
    child environment, the preflight, a greedy chat workload of args.num_requests x args.output_len
    in `work`, and the CLI's path."""
    env = child_env(args.cache, work / "tmp")
    pre = preflight(args.python, env)
    wl = argparse.Namespace(workload="chat", num_requests=args.num_requests, output_len=args.output_len,
                            seed=args.seed, input_len=None, prefix_len=None)
    workload = work / "workload.jsonl"
    make_workload(wl, pre["served_model_name"], pre["model_path"], workload)
    return env, pre, workload, str(Path(args.python).parent / "batch-pipeline")


# =============================================================================================
# Short chat lines ("Summarise in one sentence: ..."): the warm-engine benchmarks
# =============================================================================================

SUBJECTS = ("The old lighthouse keeper", "A small bakery", "The city council", "A group of students", "The river",
            "A stray cat", "The night train", "An early frost", "The village library", "A retired pilot",
            "The football team", "A street musician")
EVENTS = ("opened its doors again after a long winter", "found a map hidden behind a loose brick",
          "voted to plant a hundred trees along the main road", "built a small robot that waters plants",
          "flooded the lower fields after three days of rain", "followed the postman on his whole round",
          "arrived two hours late because of snow on the tracks", "ruined most of the apple harvest",
          "started lending tools as well as books", "flew one last time over the mountains",
          "won the regional cup with a goal in the final minute", "played the same song every morning at the station")
DETAILS = ("Neighbours came to help.", "Nobody knows who drew it.", "The work starts next spring.",
           "It cost less than a bicycle.", "The farmers lost a week of work.", "He gave it a name.",
           "Passengers were given free tea.", "Prices at the market went up.", "The idea came from a child.",
           "His grandson was on board.", "The whole town celebrated.", "People began to sing along.")


def short_text(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(EVENTS)}. {rng.choice(DETAILS)}"


def summary_bodies(seed: str, id_prefix: str, lines: int, served: str, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """`lines` (custom_id, body) pairs "Summarise in one sentence: <a short text>"; line j's text from
    random.Random(f"{seed}-{j}"), its custom_id f"{id_prefix}-{j}"."""
    out = []
    for j in range(lines):
        rng = random.Random(f"{seed}-{j}")
        out.append((f"{id_prefix}-{j}", {
            "model": served, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Summarise in one sentence: {short_text(rng)}"}]}))
    return out


def batch_text(bodies: list[tuple[str, dict[str, Any]]]) -> str:
    """The lines of a batch file, one request of (custom_id, body) each."""
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT_URL, "body": body}) + "\n"
                   for cid, body in bodies)


def write_batch(path: Path, bodies: list[tuple[str, dict[str, Any]]]) -> None:
    path.write_text(batch_text(bodies))

"""/v1/score and /v1/rerank lines, with the bundled all-MiniLM-L6-v2 as the scoring model.

The scores must be the cosine of the embeddings /v1/embeddings returns for the same texts (within
1e-4), rerank order must follow them, vLLM's own response models must accept the bodies, and one
file mixing score, rerank, chat and embedding lines answers each line once.
"""

from __future__ import annotations

import json
import math

from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from batch_pipeline import contract
from batch_pipeline.io import storage
from batch_pipeline_tests.support.asset_runs import DATE, materialize, read_jsonl, write_batch
from batch_pipeline_tests.support import EMBED_NAME, TINY_NAME

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin is the capital of Germany."]


def request(custom_id: str, url: str, **body) -> str:
    body.setdefault("model", TINY_NAME if url == contract.CHAT_URL else EMBED_NAME)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_score_and_rerank_follow_the_embeddings_in_a_mixed_file(tiny_llm, tmp_path):
    from vllm.entrypoints.pooling.scoring.protocol import RerankResponse, ScoreResponse

    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "mixed.jsonl", [
        request("score-1n", contract.SCORE_URL, queries=QUERY, documents=DOCS),
        request("score-nn", contract.SCORE_URL, text_1=[QUERY, DOCS[1]], text_2=[DOCS[0], DOCS[2]]),
        request("rerank", contract.RERANK_URL, query=QUERY, documents=DOCS),
        request("rerank-top", contract.RERANK_URL, query=QUERY, documents=DOCS, top_n=2, return_documents=False),
        request("embed", contract.EMBEDDINGS_URL, input=[QUERY, *DOCS]),
        request("chat", contract.CHAT_URL, messages=[{"role": "user", "content": "hi"}], max_tokens=3),
        request("no-documents", contract.SCORE_URL, queries=QUERY),
        request("query-list", contract.RERANK_URL, query=[QUERY, DOCS[0]], documents=DOCS),
        request("uneven", contract.SCORE_URL, queries=[QUERY, DOCS[0]], documents=DOCS),
        request("empty-docs", contract.RERANK_URL, query=QUERY, documents=[]),
        request("other-model", contract.SCORE_URL, model=TINY_NAME, queries=QUERY, documents=DOCS),
    ])
    assert materialize(tiny_llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/mixed"
    outputs = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["chat", "embed", "rerank", "rerank-top", "score-1n", "score-nn"]  # each once
    assert sorted(errors) == ["empty-docs", "no-documents", "other-model", "query-list", "uneven"]

    ChatCompletion.model_validate(outputs["chat"])
    vectors = [d.embedding for d in CreateEmbeddingResponse.model_validate(outputs["embed"]).data]
    query, docs = vectors[0], vectors[1:]
    expected = [cosine(query, d) for d in docs]

    score = ScoreResponse.model_validate(outputs["score-1n"])
    assert [d.index for d in score.data] == [0, 1, 2] and score.model == EMBED_NAME
    assert all(abs(d.score - e) < 1e-4 for d, e in zip(score.data, expected)), ([d.score for d in score.data], expected)
    assert score.usage.prompt_tokens > 0

    pairs = ScoreResponse.model_validate(outputs["score-nn"])
    assert abs(pairs.data[0].score - expected[0]) < 1e-4  # (query, Paris)
    assert abs(pairs.data[1].score - cosine(docs[1], docs[2])) < 1e-4  # (bananas, Berlin)

    rerank = RerankResponse.model_validate(outputs["rerank"])
    by_relevance = sorted(range(3), key=lambda i: -expected[i])
    assert [r.index for r in rerank.results] == by_relevance and by_relevance[0] == 0  # Paris first
    assert [r.document.text for r in rerank.results] == [DOCS[i] for i in by_relevance]
    assert all(abs(r.relevance_score - expected[r.index]) < 1e-4 for r in rerank.results)

    top = RerankResponse.model_validate(outputs["rerank-top"])
    assert [r.index for r in top.results] == by_relevance[:2] and all(r.document.text is None for r in top.results)

    assert errors["no-documents"]["code"] == contract.INVALID_REQUEST
    assert "body.documents: required with queries" in errors["no-documents"]["message"]
    assert "body.query: one string" in errors["query-list"]["message"] and "/v1/score" in errors["query-list"]["message"]
    assert "body.queries: 2 texts for 3 documents" in errors["uneven"]["message"]
    assert "body.documents" in errors["empty-docs"]["message"]
    assert errors["other-model"]["code"] == contract.MODEL_NOT_FOUND and EMBED_NAME in errors["other-model"]["message"]

    batch = json.loads(storage.read_text(f"{folder}/batch.json"))
    assert batch["request_counts"] == {"total": 11, "completed": 6, "failed": 5}


def test_scoring_lines_alone_load_no_generation_model(tiny_llm):
    logs: list[str] = []
    with tiny_llm.open(log=logs.append) as engines:
        answers = list(engines.stream("batch_x", [
            contract.BatchRequest(line=i + 1, custom_id=f"r{i}", url=contract.RERANK_URL,
                                  body={"model": EMBED_NAME, "query": QUERY, "documents": DOCS[i:]})
            for i in range(3)], created=0))
    assert sorted(a.line for a in answers) == [1, 2, 3] and all(a.kind == "output" for a in answers)
    assert [len(a.record["response"]["body"]["results"]) for a in sorted(answers, key=lambda a: a.line)] == [3, 2, 1]
    assert not any("generate model" in m for m in logs), logs


def build_tiny_cross_encoder(dest) -> str:
    """A random 2-layer BERT reranker (BertForSequenceClassification, one label) with MiniLM's
    tokenizer: the shape of cross-encoder/ms-marco-MiniLM, built once per folder (models.build_once,
    as the tiny Llama)."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from batch_pipeline.config import models

    def build(tmp) -> dict:
        source = models.embedding_model_dir()
        torch.manual_seed(0)
        # head_dim 32, MiniLM's: vLLM's CPU attention has no kernel for 16.
        config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128, max_position_embeddings=512, num_labels=1)
        BertForSequenceClassification(config).save_pretrained(tmp, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        return {"kind": "tiny-cross-encoder", "format": 1}

    def is_current(marker: dict) -> bool:
        return marker.get("kind") == "tiny-cross-encoder" and marker.get("format") == 1

    return str(models.build_once(dest, is_current, build, log=lambda _m: None, what="tiny cross-encoder"))


def test_a_cross_encoder_set_by_score_model_path_reads_each_pair(tiny_llm, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from batch_pipeline.config import models

    path = build_tiny_cross_encoder(models.cache_root() / "test-models" / "tiny-cross-encoder")
    llm = tiny_llm.rebuilt(score_model_path=path)
    inbox, out = tmp_path / "in", tmp_path / "out"
    write_batch(inbox / DATE, "cross.jsonl", [
        request("score", contract.SCORE_URL, model="tiny-cross-encoder", queries=QUERY, documents=DOCS),
        request("rerank", contract.RERANK_URL, model="tiny-cross-encoder", query=QUERY, documents=DOCS),
        request("embedding-model", contract.SCORE_URL, queries=QUERY, documents=DOCS),  # not the scoring model now
    ])
    assert materialize(llm, str(inbox), str(out)).success
    folder = f"{out}/{DATE}/cross"
    outputs = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(f"{folder}/output.jsonl")}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(f"{folder}/errors.jsonl")}
    assert sorted(outputs) == ["rerank", "score"] and errors["embedding-model"]["code"] == contract.MODEL_NOT_FOUND

    # The same model in transformers: sigmoid of the logit of each (query, document) pair.
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        logits = model(**tokenizer([QUERY] * 3, DOCS, return_tensors="pt", padding=True)).logits.squeeze(-1)
    expected = torch.sigmoid(logits).tolist()
    scores = [d["score"] for d in outputs["score"]["data"]]
    assert all(abs(s - e) < 1e-3 for s, e in zip(scores, expected)), (scores, expected)
    assert [r["index"] for r in outputs["rerank"]["results"]] == sorted(range(3), key=lambda i: -expected[i])

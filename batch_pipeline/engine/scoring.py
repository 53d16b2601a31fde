"""/v1/score and /v1/rerank with vLLM's `LLM.score` on a pooling model.

By default the embedding model scores (a bi-encoder: the cosine of the two texts' embeddings, the
same embeddings /v1/embeddings returns); SCORE_MODEL_PATH sets a cross-encoder (a
`*ForSequenceClassification` reranker with one label) that reads each pair together. The bodies
are the ones vLLM's server returns (its ScoreResponse and RerankResponse accept them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batch_pipeline import contract
from batch_pipeline.contract import lines
from batch_pipeline.base import ids
from batch_pipeline.engine import vllm_adapter
from batch_pipeline.contract.lines import Answer


class ScoringEngine(vllm_adapter.ServedModel):
    """A pooling-runner `LLM` answering /v1/score and /v1/rerank lines."""

    def run(self, batch_id: str, requests: Sequence[contract.BatchRequest], created: int) -> list[Answer]:
        answers = []
        for req in requests:
            of = req.batch_id or batch_id  # the request's own batch, when a stream answers several
            body = req.parsed_body()
            if req.url == contract.RERANK_URL:
                left, right = [body.query], body.document_list()
            else:
                left, right = body.pairs_sides()
            too_long = self._too_long(left + right)
            if too_long:
                answers.append(lines.contract_error(of, req, contract.CONTEXT_LENGTH_EXCEEDED, too_long))
                continue
            try:
                outs = self.llm.score(left if len(left) > 1 else left[0], right, use_tqdm=False)
                failed = next((o.error for o in outs if getattr(o, "error", None) is not None), None)
                if failed is not None:
                    raise RuntimeError(str(failed))
            except Exception as e:  # noqa: BLE001 - e.g. a pair longer than a cross-encoder's context
                answers.append(lines.engine_error(of, req, e))
                continue
            prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outs)
            scores = [float(o.outputs.score) for o in outs]
            if req.url == contract.RERANK_URL:
                payload = rerank_body(of, req.line, body, right, scores, self.served_model_name, prompt_tokens)
            else:
                payload = score_body(of, req.line, scores, self.served_model_name, created, prompt_tokens)
            answers.append(lines.success(of, req, payload, prompt_tokens, 0))
        return answers

    def _too_long(self, texts: list[str]) -> str | None:
        longest = max(len(self.tokenizer.encode(text)) for text in texts)
        if longest > self.max_model_len:
            return f"a text is {longest} tokens; the scoring model's limit is {self.max_model_len}"
        return None


def score_body(batch_id: str, line: int, scores: list[float], model: str, created: int, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ScoreResponse: one score per (query, document) pair, in pair order."""
    return {
        "id": ids.completion_id("score", batch_id, line),
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }


def rerank_body(batch_id: str, line: int, body: Any, documents: list[str], scores: list[float], model: str,
                prompt_tokens: int) -> dict[str, Any]:
    """vLLM's RerankResponse: documents by falling relevance, the first `top_n` (0: all); each keeps
    its index in the request. Without `return_documents` a result's document text is null."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if body.top_n:
        order = order[: body.top_n]
    return {
        "id": ids.completion_id("rerank", batch_id, line),
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        "results": [
            {"index": i, "document": {"text": documents[i] if body.return_documents else None}, "relevance_score": scores[i]}
            for i in order
        ],
    }

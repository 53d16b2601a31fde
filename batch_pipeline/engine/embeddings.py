"""/v1/embeddings on a second vLLM `LLM` with the pooling runner (`LLM.embed`)."""

from __future__ import annotations

from collections.abc import Sequence
from batch_pipeline import contract
from batch_pipeline.contract import lines
from batch_pipeline.engine import bodies, vllm_adapter
from batch_pipeline.contract.lines import Answer


class EmbeddingEngine(vllm_adapter.ServedModel):
    """A pooling-runner `LLM` serving /v1/embeddings."""

    def run(self, batch_id: str, requests: Sequence[contract.BatchRequest]) -> list[Answer]:
        from vllm import PoolingParams

        answers: list[Answer] = []
        for req in requests:
            of = req.batch_id or batch_id  # the request's own batch, when a stream answers several
            body = req.parsed_body()
            inputs = body.inputs()
            longest = max(len(self.tokenizer.encode(text)) for text in inputs)
            if longest > self.max_model_len:
                message = f"an input is {longest} tokens; the embedding model's limit is {self.max_model_len}"
                answers.append(lines.contract_error(of, req, contract.CONTEXT_LENGTH_EXCEEDED, message))
                continue
            # Requests differ in `dimensions`, so each request is its own embed call over its inputs;
            # the pooling runner is not the bottleneck of a batch that is mostly generation.
            try:
                params = PoolingParams(dimensions=body.dimensions) if body.dimensions else None
                outs = self.llm.embed(inputs, pooling_params=params, use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - e.g. dimensions on a model without Matryoshka
                answers.append(lines.engine_error(of, req, e))
                continue
            answers.append(bodies.embeddings_body(of, req, body, outs, self.served_model_name))
        return answers

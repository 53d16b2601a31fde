"""/v1/score and /v1/rerank bodies, as vLLM's server takes them (its ScoreRequest and RerankRequest)."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, model_validator

from batch_pipeline.contract.common import LenientModel

ScoreText = Annotated[str, Field(min_length=1)]
ScoreTexts = Union[ScoreText, Annotated[list[ScoreText], Field(min_length=1)]]
# vLLM's names for the two sides of a score request, newest first: (first, second).
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))


class ScoreBody(LenientModel):
    """Similarity of each query with each document: 1 -> 1, 1 -> N or N -> N pairs."""

    model: str = Field(min_length=1)
    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None

    @model_validator(mode="after")
    def _two_sides(self) -> "ScoreBody":
        given = [(a, b) for a, b in SCORE_SIDES if getattr(self, a) is not None or getattr(self, b) is not None]
        if not given:
            raise ValueError("queries and documents are required")
        first, second = given[0]
        if getattr(self, first) is None:
            raise ValueError(f"{first}: required with {second}")
        if getattr(self, second) is None:
            raise ValueError(f"{second}: required with {first}")
        left, right = self.pairs_sides()
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"{first}: {len(left)} texts for {len(right)} {second}; give one, or one per {second[:-1] if second.endswith('s') else second}")
        return self

    def sides(self) -> tuple[str, str]:
        return next((a, b) for a, b in SCORE_SIDES if getattr(self, a) is not None)

    def pairs_sides(self) -> tuple[list[str], list[str]]:
        first, second = self.sides()
        a, b = getattr(self, first), getattr(self, second)
        return ([a] if isinstance(a, str) else list(a)), ([b] if isinstance(b, str) else list(b))


class RerankBody(LenientModel):
    """One query, its documents ranked by relevance (Cohere/Jina shape, as vLLM serves it)."""

    model: str = Field(min_length=1)
    query: ScoreText
    documents: ScoreTexts
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    @model_validator(mode="before")
    @classmethod
    def _one_query(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("query"), list):
            raise ValueError("query: one string is ranked against the documents; for several queries use /v1/score")
        return data

    def document_list(self) -> list[str]:
        return [self.documents] if isinstance(self.documents, str) else list(self.documents)

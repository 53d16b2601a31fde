"""/v1/completions bodies (OpenAI's legacy completions endpoint)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Union

from pydantic import Field

from batch_pipeline.contract.chat import ResponseFormat
from batch_pipeline.contract.common import COMPLETIONS_DEFAULT_MAX_TOKENS, COMPLETIONS_URL, SamplingBody


class CompletionBody(SamplingBody):
    ENDPOINT: ClassVar[str] = COMPLETIONS_URL
    prompt: Union[str, Annotated[list[str], Field(min_length=1)]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    response_format: ResponseFormat | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

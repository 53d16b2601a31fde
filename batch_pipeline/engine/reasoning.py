"""Reasoning models: the thinking split from the answer by one of vLLM's reasoning parsers.

With REASONING_PARSER set (vLLM's parser names: `deepseek_r1`, `qwen3`, `openai_gptoss`, ...),
a chat answer's raw text is split into `message.reasoning_content` (also under vLLM's newer name
`reasoning`) and `content`, and the thinking tokens are counted into
`usage.completion_tokens_details.reasoning_tokens`. The parser is vLLM's own, built on the model's
tokenizer, as `vllm serve --reasoning-parser` and vLLM's run-batch build it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from batch_pipeline.engine import vllm_adapter
from batch_pipeline.config.settings import ConfigError


class ReasoningConfigError(ConfigError):
    """REASONING_PARSER cannot be used with this model; the message names the variable."""


@dataclass
class Split:
    reasoning: str | None
    content: str
    reasoning_tokens: int


def parser_names() -> list[str]:
    return vllm_adapter.reasoning_parser_names()


class Reasoning:
    """One vLLM reasoning parser on one model's tokenizer."""

    def __init__(self, name: str, tokenizer: Any, model: str = ""):
        self.name = name
        self.tokenizer = tokenizer
        try:
            cls = vllm_adapter.reasoning_parser_class(name)
        except KeyError:
            raise ReasoningConfigError(
                f"REASONING_PARSER={name!r} is not one of vLLM's reasoning parsers; choose one of {', '.join(parser_names())}"
            ) from None
        try:
            self.parser = cls(tokenizer)
        except Exception as e:  # noqa: BLE001 - e.g. the model's tokenizer has no <think> token
            raise ReasoningConfigError(
                f"REASONING_PARSER={name} does not fit the model{f' {model}' if model else ''}: {e} "
                "(is it a reasoning model of that family?)"
            ) from e
        # Some parsers need the thinking markers kept in the decoded text (they are special tokens
        # in some models): the parser says so by adjusting a request, as vLLM's server lets it.
        adjusted = self.parser.adjust_request(types.SimpleNamespace(skip_special_tokens=True, spaces_between_special_tokens=True))
        self.sampling_overrides = {
            "skip_special_tokens": getattr(adjusted, "skip_special_tokens", True),
            "spaces_between_special_tokens": getattr(adjusted, "spaces_between_special_tokens", True),
        }

    def split(self, text: str, token_ids: Any, chat_template_kwargs: dict[str, Any] | None = None,
              constrained: bool = False) -> Split:
        """The thinking and the answer of one generated text. A text cut off inside the thinking
        (max_tokens) has all of it as reasoning and an empty answer, as OpenAI reports it.

        `constrained`: the text was generated under a structured-output constraint, which applies
        from the first token; such a text without any think tag is all answer (the parsers that
        follow DeepSeek-R1 would take a tagless text for thinking)."""
        markers = [m for m in (self.parser.reasoning_start_str, self.parser.reasoning_end_str) if m]
        if constrained and markers and not any(m in text for m in markers):
            return Split(reasoning=None, content=text, reasoning_tokens=0)
        request = types.SimpleNamespace(chat_template_kwargs=chat_template_kwargs or {}, skip_special_tokens=True)
        reasoning, content = self.parser.extract_reasoning(text, request)
        count = self.parser.count_reasoning_tokens(list(token_ids)) if reasoning else 0
        if reasoning and count == 0:
            # Markers spelled over several tokens (or a parser that does not count): the thinking's
            # own tokens, counted with the model's tokenizer.
            count = len(self.tokenizer.encode(reasoning, add_special_tokens=False))
        return Split(reasoning=reasoning or None, content=content or "", reasoning_tokens=count)


def template_takes(tokenizer: Any, name: str) -> bool:
    """Whether the model's chat template reads the variable `name` (e.g. reasoning_effort)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return bool(template) and name in str(template)

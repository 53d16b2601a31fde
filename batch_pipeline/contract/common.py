"""What every endpoint family of the contract shares: the endpoints, the error codes of error lines,
the base models (lenient or strict on unknown fields) and each body field's fate (honoured, ignored
or refused naming it).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
SCORING_URLS = (SCORE_URL, RERANK_URL)
RESPONSES_URL = "/v1/responses"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions endpoint: max_tokens when a line gives none
SUPPORTED_URLS = (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    SCORE_URL,
    RERANK_URL,
    RESPONSES_URL,
)

MAX_CUSTOM_ID_LENGTH = 64

# Error codes used in error lines (BATCH_CONTRACT.md, "Error file").
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_URL = "unsupported_url"
URL_MISMATCH = "url_mismatch"  # a line whose url is not its batch's endpoint (the Batch API's, as OpenAI names it)
INVALID_METHOD = "invalid_method"
MODEL_NOT_FOUND = "model_not_found"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"


class LenientModel(BaseModel):
    """Request parts: unknown fields are accepted and ignored, like the online endpoint does."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


StopField = Union[str, Annotated[list[str], Field(max_length=4)], None]
# OpenAI's `reasoning_effort` values (chat) and `reasoning.effort` (Responses).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# ------------------------------------------------------------------ every body field, one fate
#
# A batch that quietly does something other than what a line asked for is worse than one that
# refuses the line. So a chat, completions or embeddings body field is either honoured (a field of
# the body model below, or one of vLLM's extensions), ignored because it changes nothing offline,
# or refused per line naming it, with the reason; a field this pipeline does not know is refused
# too (as OpenAI's own API refuses an unrecognized argument). docs/CONTRACT.md has the table.

# Change nothing in an offline batch: accepted and ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                            "stream_options"})
# vLLM's own sampling extensions (SamplingParams fields), honoured as its server honours them.
VLLM_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                        "bad_words", "allowed_token_ids")
_GUIDED = "vLLM's old guided_* fields are gone: use structured_outputs ({\"regex\": ...}, {\"json\": ...}, ...)"
# Chat declares the tool fields (ChatBody); on other endpoints they could only be ignored.
_TOOLS_CHAT_ONLY = "tools are called on /v1/chat/completions lines only"
# Known, and impossible here: refused, with the reason.
REFUSED_FIELDS = {
    "audio": "audio output cannot be produced: the served models write text",
    "prediction": "predicted outputs are not supported by vLLM's offline engine",
    "web_search_options": "web search runs on OpenAI's servers and cannot run in an offline batch",
    "functions": "the legacy functions API is not supported; declare tools instead",
    "function_call": "the legacy functions API is not supported; use tool_choice instead",
    "verbosity": "the served models have no verbosity setting; say how long to answer in the prompt",
    "tools": _TOOLS_CHAT_ONLY,
    "tool_choice": _TOOLS_CHAT_ONLY,
    "parallel_tool_calls": _TOOLS_CHAT_ONLY,
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "prompt_logprobs": "prompt logprobs have no place in OpenAI's response bodies",
}


@functools.cache
def _declared(model: type[BaseModel]) -> frozenset[str]:
    """A body model's field names and aliases (once per model, not once per line)."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def check_fields(data: Any, model: type[BaseModel], endpoint: str, extensions: tuple[str, ...] = ()) -> None:
    """Refuse (ValueError naming the field) a body field that would otherwise be silently ignored."""
    if not isinstance(data, dict):
        return
    known = _declared(model)
    for key, value in data.items():
        if key in known or key in IGNORED_FIELDS or key in extensions:
            continue
        if key == "stream":
            if value not in (None, False):
                raise ValueError("stream: a batch line cannot be streamed: leave stream out or false")
            continue
        if key == "modalities":
            if value not in (None, ["text"]):
                raise ValueError(f"modalities: only [\"text\"] can be produced here (got {json.dumps(value)[:60]})")
            continue
        if key in REFUSED_FIELDS:
            raise ValueError(f"{key}: {REFUSED_FIELDS[key]}")
        raise ValueError(f"{key}: not a field of {endpoint} this pipeline knows; it would be ignored, so the line is "
                         "refused (docs/CONTRACT.md lists every field)")


class SamplingBody(LenientModel):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    # OpenAI's token id (as a string) -> bias from -100 to 100, added to that token's logit.
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's own extension: constrain the output to a regex, a choice, a JSON schema or a grammar.
    structured_outputs: dict[str, Any] | None = None

    # Subclasses say which endpoint they are, for the message of a refused field.
    ENDPOINT: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _every_field_honoured_or_refused(cls, data: Any) -> Any:
        check_fields(data, cls, cls.ENDPOINT, VLLM_SAMPLING_EXTRAS)
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

"""A model's chat template, rendered with jinja2 alone for the plan's keys (steps/ordering.py).

The plan keys a chat request on its prompt as the engine will see it: the chat template's
rendering. Loading the model's tokenizer through transformers for that costs its import, 7-8 s of
CPU on a 2-core machine: most of what a run on a warm engine would spend before its first request,
since nothing else in such a run needs transformers. The template is a jinja2 text next to the
weights, so it is rendered here as transformers renders it
(`transformers.utils.chat_template_utils`): a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that does not escape HTML,
`raise_exception` and `strftime_now`, and the tokenizer's named special tokens as variables.

Where the template is looked for, in transformers' order: `chat_template.jinja` and the named ones in
`additional_chat_templates/` (these win), else `chat_template` in `tokenizer_config.json` (a text,
or a list of named ones), else `chat_template.json` (a processor's). Of named templates, `tool_use`
serves requests with tools when there is one, else `default`.

A template this cannot read or compile returns None here, and the caller loads the tokenizer as
before (`ordering.chat_template_renderer`); a line it cannot render still gets a key from its
own text (contract/prompts.py).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from batch_pipeline.contract.prompts import Render

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def templates(model_dir: Path) -> dict[str, str] | None:
    """The model's chat templates by name ("default" for the single one), or None when it has none."""
    found: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        found["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        found.update({f.name.removesuffix(".jinja"): f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))})
    if found:
        return found
    for source in ("tokenizer_config.json", "chat_template.json"):
        given = _read_json(model_dir / source).get("chat_template")
        if isinstance(given, str) and given:
            return {"default": given}
        if isinstance(given, list):
            named = {t["name"]: t["template"] for t in given if isinstance(t, dict) and "name" in t and "template" in t}
            if named:
                return named
    return None


def special_tokens(model_dir: Path) -> dict[str, str]:
    """The tokenizer's named special tokens (bos_token, eos_token, ...) as its template sees them."""
    tokens: dict[str, str] = {}
    for source in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's own win
        for name, value in _read_json(model_dir / source).items():
            if name in SPECIAL_TOKENS:
                content = value.get("content") if isinstance(value, dict) else value
                if isinstance(content, str):
                    tokens[name] = content
    return tokens


def renderer(model_path: str) -> Render | None:
    """The model's chat template as a renderer (messages, tools) -> prompt text with the generation
    prompt added; None when the folder has no template or it does not compile."""
    model_dir = Path(model_path)
    try:
        named = templates(model_dir)
        if not named:
            return None
        tokens = special_tokens(model_dir)
        env = _environment()
        compiled = {name: env.from_string(text) for name, text in named.items()}
    except Exception:  # noqa: BLE001 - the caller falls back to the tokenizer's own rendering
        return None
    if len(compiled) > 1 and "default" not in compiled and "tool_use" not in compiled:
        return None  # transformers too refuses to pick one: left to it

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        template = compiled.get("tool_use") if tools is not None and "tool_use" in compiled else compiled.get("default")
        if template is None:
            raise ValueError("the model's chat templates have no default")
        return template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True, **tokens)

    return render


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: dt.datetime.now().strftime(format)
    return env

"""The plan's chat-template keys rendered with jinja2 alone (steps/chat_template.py) are the text
transformers' `apply_chat_template` gives, and a run that plans never imports transformers for them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batch_pipeline.steps import chat_template, ordering

# A template in the style of tool-calling models: tools as JSON, a system turn made up when absent,
# loop controls, raise_exception and the bos token.
TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
{%- endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}
{%- if loop.first and message['role'] != 'system' %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{%- if message['content'] == 'skip me' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  <b>café</b> & \"quotes\" 你好 "}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "skip me"},
     {"role": "user", "content": "and again"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def transformers_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained


def _model(tmp_path: Path, tiny_model_dir: Path, jinja: str | None = None, config_template=None) -> Path:
    """The tiny model's tokenizer in a folder of its own, with the chat template(s) given."""
    out = tmp_path / "model"
    out.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", out)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = {"__type": "AddedToken", "content": config["bos_token"], "lstrip": False, "rstrip": False, "special": True,
                           "normalized": False, "single_word": False}
    if config_template is not None:
        config["chat_template"] = config_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    return out


def _same_as_transformers(model_dir: Path, load) -> int:
    render = chat_template.renderer(str(model_dir))
    assert render is not None
    tokenizer = load(str(model_dir))
    compared = 0
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            expected = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert render(messages, tools) == expected, (messages, tools)
            compared += 1
    return compared


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_template_renders_as_transformers_renders_it(tmp_path, tiny_model_dir, transformers_tokenizer, where):
    model_dir = (_model(tmp_path, tiny_model_dir, jinja=TOOLS_TEMPLATE) if where == "chat_template.jinja"
                 else _model(tmp_path, tiny_model_dir, config_template=TOOLS_TEMPLATE))
    assert _same_as_transformers(model_dir, transformers_tokenizer) == 6


def test_the_tiny_and_named_templates_render_as_transformers_renders_them(tmp_path, tiny_model_dir, transformers_tokenizer):
    assert _same_as_transformers(tiny_model_dir, transformers_tokenizer) == 6
    named = [{"name": "default", "template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"},
             {"name": "tool_use", "template": TOOLS_TEMPLATE}]
    model_dir = _model(tmp_path, tiny_model_dir, config_template=named)
    assert _same_as_transformers(model_dir, transformers_tokenizer) == 6
    render = chat_template.renderer(str(model_dir))
    assert render is not None and "<tools>" in render(CONVERSATIONS[0], TOOLS) and "[user]" in render(CONVERSATIONS[0], None)


def test_a_template_jinja_alone_cannot_take_goes_to_the_tokenizer(tmp_path, tiny_model_dir):
    generation = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    model_dir = _model(tmp_path, tiny_model_dir, jinja=generation)
    assert chat_template.renderer(str(model_dir)) is None  # transformers' own tag: left to transformers
    ordering.chat_template_renderer.cache_clear()
    render, keyed_on = ordering.chat_template_renderer(str(model_dir))
    assert render is not None and render(CONVERSATIONS[0], None) == CONVERSATIONS[0][0]["content"]
    assert chat_template.renderer(str(tmp_path / "nothing-here")) is None


def test_a_run_planning_on_a_template_does_not_import_transformers(tiny_model_dir):
    code = textwrap.dedent(f"""
        import sys
        from batch_pipeline.steps import ordering
        render, keyed_on = ordering.chat_template_renderer({str(tiny_model_dir)!r})
        assert render is not None and keyed_on.startswith("the chat template of "), keyed_on
        assert render([{{"role": "user", "content": "hi"}}], None).endswith("<|im_start|>assistant\\n")
        print(sorted(m for m in ("transformers", "torch", "vllm") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

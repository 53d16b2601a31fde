"""SmolLM2 with think tags: the bundled model, its tokenizer taught `<think>` and `</think>`.

No reasoning model can be downloaded here. Reasoning models (Qwen3, DeepSeek-R1 distills) carry
`<think>` and `</think>` as single added tokens, and vLLM's reasoning parsers look them up by id.
This copy of SmolLM2 renames two special tokens it never uses (`<issue_start>`, `<issue_comment>`,
ids 8 and 9) to those tags, as non-special tokens (so they stay in the decoded text, as a reasoning
model's do). Weights are linked, not copied; the model is the same, only the tokenizer differs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from batch_pipeline.config.models import build_once

THINKING_FORMAT = 1
RENAMED = {"<issue_start>": "<think>", "<issue_comment>": "</think>"}


def build_thinking_smollm2(source: Path, dest: Path) -> Path:
    """Build (once) the think-tag copy of the bundled SmolLM2 in `dest`."""
    source, dest = Path(source), Path(dest)

    def is_current(marker: dict) -> bool:
        return marker.get("kind") == "smollm2-thinking" and marker.get("format") == THINKING_FORMAT

    def build(tmp: Path) -> dict:
        for item in source.iterdir():
            if item.name.startswith("."):
                continue
            if item.suffix == ".safetensors":
                os.symlink(item.resolve(), tmp / item.name)
            elif item.name != "tokenizer.json":
                shutil.copy2(item, tmp / item.name)
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        for token in tokenizer["added_tokens"]:
            if token["content"] in RENAMED:
                token["content"] = RENAMED[token["content"]]
                token["special"] = False
        vocab = tokenizer["model"]["vocab"]
        for old, new in RENAMED.items():
            if old in vocab:
                vocab[new] = vocab.pop(old)
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        return {"kind": "smollm2-thinking", "format": THINKING_FORMAT, "source": str(source)}

    return build_once(dest, is_current, build, log=lambda _: None, what="SmolLM2 with think tags")

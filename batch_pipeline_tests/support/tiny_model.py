"""A tiny random Llama for tests: 2 layers, 1.8 MB, a real byte-level BPE tokenizer and ChatML.

vLLM loads it in seconds, so most tests run the real engine on it; its answers are gibberish, but
shapes, token counts and every code path are real. Built once per folder with the same
marker-and-rename scheme as the bundled model (`models.build_once`).
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

from batch_pipeline.config.models import CHATML_TEMPLATE, build_once

TINY_FORMAT = 1
TINY_SEED = 0


def build_tiny_llama(dest: Path) -> Path:
    """Build (once) a random 2-layer Llama (1.8 MB) with a byte-level BPE tokenizer and ChatML."""
    dest = Path(dest)

    def is_current(marker: dict) -> bool:
        return marker.get("kind") == "tiny-llama" and marker.get("format") == TINY_FORMAT

    def build(tmp: Path) -> dict:
        vocab_size = _write_tiny_tokenizer(tmp)
        _write_tiny_weights(tmp, vocab_size)
        return {"kind": "tiny-llama", "format": TINY_FORMAT, "seed": TINY_SEED}

    return build_once(dest, is_current, build, log=lambda _: None, what="tiny llama")


# Token ids 0-3, in this order; eos is <|im_end|> so chat generations stop at the turn's end.
_TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
_TINY_BOS, _TINY_EOS, _TINY_PAD = 0, 2, 3


def _write_tiny_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string maps to tokens, so no input is ever unknown.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=_TINY_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tiny_corpus(random.Random(TINY_SEED)), trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _TINY_SPECIAL[_TINY_BOS],
        "eos_token": _TINY_SPECIAL[_TINY_EOS],
        "pad_token": _TINY_SPECIAL[_TINY_PAD],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer.get_vocab_size()


def _tiny_corpus(rng: random.Random) -> Iterator[str]:
    words = (
        "the a of to and in is it you that he was for on are with as I his they be at one have "
        "this from or had by word but what some we can out other were all there when up use your "
        "how said an each she which do their time if will way about many then them write would "
        "like so these her long make thing see him two has look more day could go come did number "
        "sound no most people my over know water than call first who may down side been now find "
        "capital France Paris question answer model batch request json user assistant system"
    ).split()
    hanzi = "你好世界今天天气很好我们中国北京上海人工智能模型问题答案请谢谢是的不一二三"
    symbols = "0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\n\t"
    for _ in range(2000):
        parts = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        parts.append(str(rng.randint(0, 100000)))
        parts.append("".join(rng.choice(hanzi) for _ in range(rng.randint(1, 6))))
        parts.append("".join(rng.choice(symbols) for _ in range(rng.randint(1, 4))))
        rng.shuffle(parts)
        yield " ".join(parts)


def _write_tiny_weights(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        # vLLM's CPU attention rejects head_dim 16; 32 works.
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=_TINY_BOS,
        eos_token_id=_TINY_EOS,
        pad_token_id=_TINY_PAD,
        dtype="float32",
    )
    with _seeded(TINY_SEED):
        model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=_TINY_BOS, eos_token_id=_TINY_EOS, pad_token_id=_TINY_PAD
    )
    model.save_pretrained(out)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

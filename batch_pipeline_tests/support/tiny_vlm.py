"""A tiny random vision-language model for tests: Idefics3 (SmolVLM's architecture), 2 text layers.

vLLM's CPU build runs it: a 2-layer SigLIP-style encoder (64x64 images, 16x16 patches) whose 16
patches are pixel-shuffled into 4 `<image>` tokens, a connector, and the tiny Llama's text model and
byte-level tokenizer (tiny_model.py) with Idefics3's image tokens added. Torchvision is not installed
(RECIPES.md), so the processor is transformers' PIL Idefics3 image processor, which vLLM falls back
to by itself. Image splitting is off: one image is 4 tokens plus its frame.

Weights are random but not at the usual scale: with the default 0.02 the text model's greedy
answer is the same token whatever the image (the image moves the log-probabilities by ~0.1 only).
The connector is drawn at std 1.0 and the text model's matrices at 0.2, which makes different
images give different greedy answers (measured: red, blue and white 80x60 squares give three
different 8-token answers, the same image the same answer).
"""

from __future__ import annotations

from pathlib import Path

from batch_pipeline.config.models import build_once
from batch_pipeline_tests.support.tiny_model import _seeded, _write_tiny_tokenizer

TINY_VLM_FORMAT = 1
TINY_VLM_SEED = 0
# Idefics3's processor looks these up in the tokenizer; the row/col tags only matter with splitting.
_IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
_BOS, _EOS, _PAD = 0, 2, 3
IMAGE_SIDE = 64
PATCH = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIDE // PATCH) ** 2 // SCALE_FACTOR**2  # 4


def build_tiny_vlm(dest: Path) -> Path:
    """Build (once) the random Idefics3 model (about 2.5 MB) into dest."""
    dest = Path(dest)

    def is_current(marker: dict) -> bool:
        return marker.get("kind") == "tiny-idefics3" and marker.get("format") == TINY_VLM_FORMAT

    def build(tmp: Path) -> dict:
        _write(tmp)
        return {"kind": "tiny-idefics3", "format": TINY_VLM_FORMAT, "seed": TINY_VLM_SEED}

    return build_once(dest, is_current, build, log=lambda _: None, what="tiny vision-language model")


def _write(out: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    _write_tiny_tokenizer(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS})
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
        bos_token_id=_BOS, eos_token_id=_EOS, pad_token_id=_PAD, tie_word_embeddings=True,
    )
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIDE, patch_size=PATCH,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=_PAD, tie_word_embeddings=True,
    )
    with _seeded(TINY_VLM_SEED):
        model = Idefics3ForConditionalGeneration(config).to(torch.float32)
        for name, param in model.named_parameters():
            if "connector" in name:
                torch.nn.init.normal_(param, 0.0, 1.0)
            elif "text_model" in name and param.dim() == 2:
                torch.nn.init.normal_(param, 0.0, 0.2)
    model.generation_config = GenerationConfig(bos_token_id=_BOS, eos_token_id=_EOS, pad_token_id=_PAD)
    model.save_pretrained(out)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": IMAGE_SIDE}, max_image_size={"longest_edge": IMAGE_SIDE}
        ),
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)

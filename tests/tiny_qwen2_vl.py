"""A tiny random Qwen2-VL checkpoint (transformers' own class, saved to disk) with a word-level tokenizer whose
special tokens are the image placeholders, and a chat template that writes an image part as Qwen2-VL's does;
plus HF's greedy generate on the same inputs, the reference the engine tests compare against."""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

IMG, START, END = 500, 501, 502
PH = "<|vision_start|><|image_pad|><|vision_end|>"  # one image's place in a text prompt
BOS, EOS = 0, 1

# Qwen2-VL's chat template, reduced to what the tests need: an image part is the three placeholder tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} says "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}assistant says {% endif %}"
)


@functools.lru_cache(maxsize=None)
def tiny_qwen2_vl() -> str:
    """The checkpoint's directory (built once per test session)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from jaxserve.bench.model_shapes import write_word_tokenizer

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS,
                         max_position_embeddings=512,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0)),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=IMG, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # O(1) activations, so that a wrong image row or rotary row changes greedy tokens
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and ("norm" in name or "ln_q" in name)
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm else 0.3 * torch.randn_like(p))
    path = os.path.join(tempfile.mkdtemp(prefix="jaxserve-qwen2vl-"), "tiny-qwen2-vl")
    model.save_pretrained(path)
    write_word_tokenizer(path, 512, BOS, EOS, {IMG: "<|image_pad|>", START: "<|vision_start|>", END: "<|vision_end|>"})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def tiny_vl_llm(**overrides):
    """An LLM over the tiny checkpoint in float32, shapes compiled on first use; ``overrides`` replace these."""
    from jaxserve.llm import LLM

    kw = dict(
        dtype="float32", max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8, block_size=4,
        compilation_cache_dir="", use_tqdm_on_load=False, limit_mm_per_prompt={"image": 2}, precompile="none",
    )  # fmt: skip
    return LLM(tiny_qwen2_vl(), **{**kw, **overrides})


def image(h: int, w: int, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype="float32").eval()


def hf_greedy(path: str, prompt_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
    """HF generate's greedy tokens for (expanded) prompt ids and their images."""
    import torch

    from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor

    kw = {}
    if images:
        pixels, grid = Qwen2VLImageProcessor()(images)
        kw = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grid))
    ids = torch.tensor([prompt_ids])
    if images:  # transformers 5 computes M-RoPE rows only with the processor's token types (1: image)
        kw["mm_token_type_ids"] = (ids == IMG).long()
    with torch.no_grad():
        out = _hf_model(path).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, **kw,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()

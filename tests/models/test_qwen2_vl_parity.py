"""Qwen2-VL end to end (tower + M-RoPE decoder over the paged cache) against transformers'
Qwen2VLForConditionalGeneration: float32 logits of a prompt with one image, whole and as prefill + decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from model_batch_utils import Chunk, block_tables, empty_caches, make_batch
from PIL import Image
from transformers import Qwen2VLConfig as HFConfig
from transformers import Qwen2VLForConditionalGeneration as HFModel

from jaxserve.models.loader.qwen2_vl import load_qwen2_vl
from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor
from jaxserve.models.qwen2_vl_positions import mrope_decode_positions, mrope_positions
from jaxserve.models.qwen2_vl_vision import vision_inputs
from jaxserve.pallas_kernels.attention import paged_attention

IMG, START, END = 500, 501, 502
ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = HFConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0)),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=IMG, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = HFModel(cfg).eval()
    with torch.no_grad():  # O(1) activations: a wrong rotary row or image row shows far above rounding
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and ("norm" in name or "ln_q" in name)
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_norm else 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen2_vl")
    model.save_pretrained(path)
    return path, model


def _prompt(sizes):
    """Text, then each image (framed by START / END) followed by more text; images of (height, width)."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    pixels, grid = Qwen2VLImageProcessor()(images) if images else (None, np.zeros((0, 3), np.int64))
    ids = rng.integers(2, 400, 4).tolist()
    for n in Qwen2VLImageProcessor().num_image_tokens(grid):
        ids += [START] + [IMG] * n + [END] + rng.integers(2, 400, 3).tolist()
    return np.array(ids), pixels, grid


def _hf_logits(model, ids, pixels, grid):
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids)[None], pixel_values=None if pixels is None else torch.from_numpy(pixels),
            image_grid_thw=torch.from_numpy(grid) if len(grid) else None,
            mm_token_type_ids=torch.from_numpy((ids == IMG).astype(np.int64))[None],
        )  # fmt: skip
    return out.logits[0].numpy()


# No image (M-RoPE rows all equal), one image, two images of different sizes with text between (their
# rows share one tower call).
PROMPTS = {"text_only": [], "one_image": [(84, 112)], "two_images": [(56, 56), (112, 56)]}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prefill_logits_match_hf(checkpoint, name):
    path, hf = checkpoint
    ids, pixels, grid = _prompt(PROMPTS[name])
    assert len(grid) == len(PROMPTS[name]) and len(ids) <= 32  # fits model_batch_utils' 32-token tables
    want = _hf_logits(hf, ids, pixels, grid)
    assert want.std() > 0.1

    model, cfg = load_qwen2_vl(path, dtype=jnp.float32, attention_fn=paged_attention)
    graphdef, state = nnx.split(model)
    image_embeds = None
    if len(grid):
        positions, image_ids = vision_inputs(grid, cfg.vision.spatial_merge_size)
        encode = jax.jit(lambda s, *a: nnx.merge(graphdef, s).encode_images(*a))
        image_embeds = encode(state, pixels, positions, image_ids)  # [M, D]
    rope, delta = mrope_positions(ids, grid, image_token_id=cfg.image_token_id, spatial_merge_size=2)
    row = np.where(ids == IMG, np.cumsum(ids == IMG) - 1, -1).astype(np.int32)  # [L] image row per token

    @jax.jit
    def step(state, caches, ids_t, md, rope_t, embeds, index):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(ids_t, caches, md, mrope_positions=rope_t, image_embeds=embeds, embed_index=index)
        return m.compute_logits(hidden), caches

    def run(caches, lo, hi, table, rope_rows=None):
        """Tokens lo..hi-1 as one step, padded like the runner pads (rope rows and image rows too)."""
        ids_t, md = make_batch([Chunk(ids[lo:hi].tolist(), lo, table)])
        pad = ids_t.shape[0] - (hi - lo)
        rope_t = np.pad(rope[:, lo:hi] if rope_rows is None else rope_rows, ((0, 0), (0, pad)))
        index = np.pad(row[lo:hi], (0, pad), constant_values=-1)
        logits, caches = step(state, caches, ids_t, md, rope_t, image_embeds, index)
        return np.asarray(logits)[: hi - lo], caches

    table = block_tables(1)[0]
    whole, _ = run(empty_caches(cfg.text), 0, len(ids), table)
    np.testing.assert_allclose(whole, want, atol=ATOL, rtol=0)

    # Prefill in two chunks, the boundary inside the (first) image, then the last token as a decode step
    # whose rows come from delta (as every generated token's will).
    caches = empty_caches(cfg.text)
    cut = int(np.argmax(ids == IMG)) + 2 if len(grid) else 3
    first, caches = run(caches, 0, cut, table)
    second, caches = run(caches, cut, len(ids) - 1, table)
    np.testing.assert_allclose(np.concatenate([first, second]), want[:-1], atol=ATOL, rtol=0)
    last = len(ids) - 1
    decode, _ = run(caches, last, len(ids), table, rope_rows=mrope_decode_positions(np.array([last]), delta))
    np.testing.assert_allclose(decode, want[-1:], atol=ATOL, rtol=0)

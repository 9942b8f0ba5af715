"""The Qwen2-VL vision tower against transformers' Qwen2VisionTransformerPretrainedModel (float32, CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from jaxserve.models.loader.vision_weights import load_vision_weights
from jaxserve.models.qwen2_vl_vision import Qwen2VisionTransformer, VisionConfig, vision_inputs

TINY_VISION = dict(
    depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, in_channels=3, patch_size=4,
    temporal_patch_size=2, spatial_merge_size=2,
)  # fmt: skip


def tiny_hf_vision(seed: int = 0):
    cfg = Qwen2VLConfig(vision_config=TINY_VISION).vision_config
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen2VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():  # larger than HF's init so a wrong rotary or mask shows far above rounding
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.shape[0] in (32,) else 0.0))
    return model


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 4, 6), (1, 2, 2), (2, 2, 4)]])
def test_vision_tower_matches_hf(grids):
    hf = tiny_hf_vision()
    cfg = VisionConfig.from_hf_config(hf.config.to_dict())
    tower = Qwen2VisionTransformer(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_vision_weights(tower, {k: v.numpy() for k, v in hf.state_dict().items()}, prefix="")
    grid_thw = np.array(grids, dtype=np.int64)
    n = int(np.prod(grid_thw, axis=1).sum())
    pixels = np.random.default_rng(0).standard_normal((n, cfg.patch_dim)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid_thw)).pooler_output.numpy()
    positions, ids = vision_inputs(grid_thw, cfg.spatial_merge_size)
    got = jax.jit(lambda p, x, pos, i: nnx.merge(*p)(x, pos, i))(nnx.split(tower), pixels, positions, ids)
    assert got.shape == want.shape == (n // 4, 48)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 0.5  # O(1) outputs, so the tolerance means something


def test_padding_rows_do_not_change_real_rows():
    """Shape bucketing pads with rows of image id -1: the real images' embeddings must not move."""
    hf = tiny_hf_vision()
    cfg = VisionConfig.from_hf_config(hf.config.to_dict())
    tower = Qwen2VisionTransformer(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    positions, ids = vision_inputs(np.array([(1, 4, 6)]), 2)
    pixels = np.random.default_rng(1).standard_normal((24, cfg.patch_dim)).astype(np.float32)
    base = tower(pixels, positions, ids)
    pad = 8
    padded = tower(
        np.concatenate([pixels, np.ones((pad, cfg.patch_dim), np.float32)]),
        np.concatenate([positions, np.zeros((pad, 2), np.int32)]),
        np.concatenate([ids, np.full(pad, -1, np.int32)]),
    )
    np.testing.assert_allclose(np.asarray(padded[:6]), np.asarray(base), rtol=1e-5, atol=1e-5)


def test_batched_image_slots_equal_one_flat_call():
    """[B, N] slots (each image padded to the bucket's N rows) give the flat call's rows: the shape the
    engine should encode many images in, attention [B, Hv, N, N] instead of [Hv, B*N, B*N]."""
    hf = tiny_hf_vision()
    cfg = VisionConfig.from_hf_config(hf.config.to_dict())
    tower = Qwen2VisionTransformer(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    grids = np.array([(1, 4, 6), (1, 2, 2)])
    positions, ids = vision_inputs(grids, 2)
    pixels = np.random.default_rng(2).standard_normal((28, cfg.patch_dim)).astype(np.float32)
    flat = np.asarray(tower(pixels, positions, ids))  # [7, D]
    slot = 24  # rows per slot; the second image's 4 rows are padded with id -1 rows
    pad = lambda a, v: np.concatenate([a, np.full((slot - len(a), *a.shape[1:]), v, a.dtype)])  # noqa: E731
    batched = tower(
        np.stack([pixels[:24], pad(pixels[24:], 1.0)]),
        np.stack([positions[:24], pad(positions[24:], 0)]),
        np.stack([ids[:24], pad(ids[24:], -1)]),
    )  # [2, 6, D]
    np.testing.assert_allclose(np.asarray(batched[0]), flat[:6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(batched[1, :1]), flat[6:], rtol=1e-5, atol=1e-5)

"""M-RoPE position ids against transformers' Qwen2VLModel.get_rope_index, and the rotary tables."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLModel

from jaxserve.models.layers import mrope_cos_sin, rope_cos_sin
from jaxserve.models.qwen2_vl_positions import mrope_decode_positions, mrope_positions

IMG = 7  # the image placeholder id of these tests


def _hf_model():
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=16, vocab_size=32, rope_parameters=dict(rope_type="default",
                         mrope_section=[1, 1, 2], rope_theta=10000.0)),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2),
        image_token_id=IMG,
    )  # fmt: skip
    return Qwen2VLModel(cfg)


def _prompt(parts, grids, m=2):
    """parts: ints (text runs) and "I" (the next image's placeholders, framed by ids 5 and 6)."""
    ids, it = [], iter(grids)
    for p in parts:
        if p == "I":
            t, h, w = next(it)
            ids += [5] + [IMG] * (t * h * w // (m * m)) + [6]
        else:
            ids += list(np.random.default_rng(len(ids)).integers(8, 32, p))
    return np.array(ids)


CASES = [
    ([12], []),
    ([3, "I", 4], [(1, 4, 6)]),
    (["I"], [(1, 8, 2)]),
    ([2, "I", 5, "I", 3], [(1, 6, 4), (1, 2, 2)]),
    ([1, "I", "I", 2], [(1, 2, 10), (2, 4, 4)]),
]


@pytest.mark.parametrize("parts,grids", CASES)
def test_positions_match_hf_get_rope_index(parts, grids):
    ids = _prompt(parts, grids)
    got, delta = mrope_positions(ids, np.array(grids) if grids else None, image_token_id=IMG, spatial_merge_size=2)
    model = _hf_model()
    types = torch.from_numpy((ids == IMG).astype(np.int64))[None]
    want, want_delta = model.get_rope_index(
        torch.from_numpy(ids)[None], types, image_grid_thw=torch.tensor(grids) if grids else None
    )
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0])
    # Generated tokens continue from the prompt's largest position, as HF's decode steps do (delta added).
    np.testing.assert_array_equal(mrope_decode_positions(np.array([len(ids)]), delta)[:, 0], [got.max() + 1] * 3)


def test_wrong_placeholder_count_names_the_grids():
    with pytest.raises(ValueError, match="image_grid_thw"):
        mrope_positions(np.array([1, IMG, IMG]), np.array([[1, 4, 4]]), image_token_id=IMG, spatial_merge_size=2)


def test_mrope_tables_match_hf_recomposition():
    """Equal rows give plain RoPE; distinct rows pick frequency band j from row j % 3, as HF's rotary does."""
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)  # head_dim 8: R = 4
    section = (1, 1, 2)
    pos1 = np.array([0, 3, 9], np.int32)
    three = mrope_cos_sin(jnp.asarray(np.stack([pos1] * 3)), inv_freq, section)
    for a, b in zip(three, rope_cos_sin(jnp.asarray(pos1), inv_freq)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    model = _hf_model()
    pos3 = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 9]])
    rotary = model.language_model.rotary_emb
    cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos3)[:, None])
    cos, sin = mrope_cos_sin(jnp.asarray(pos3), np.asarray(model.language_model.rotary_emb.inv_freq), section)
    np.testing.assert_allclose(np.asarray(cos), cos_hf[0].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin), sin_hf[0].numpy(), rtol=1e-6, atol=1e-6)

"""Qwen2-VL config reading (the released checkpoints' transformers-4 config.json and transformers 5's) and
a dummy (config-only) build of the 7B shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
import torch
from transformers import Qwen2VLConfig as HFConfig
from transformers import Qwen2VLForConditionalGeneration as HFModel

from jaxserve.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from jaxserve.pallas_kernels.attention import paged_attention

# Qwen2-VL-7B-Instruct's config.json as released (transformers 4.41 field names).
QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2_vl",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 152064,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}  # fmt: skip


def test_released_7b_config():
    cfg = Qwen2VLConfig.from_hf_config(QWEN2_VL_7B)
    t, v = cfg.text, cfg.vision
    assert (t.architecture, t.mrope_section, t.rope_theta, t.rope_scaling) == ("qwen2", (16, 24, 24), 1e6, None)
    assert (t.head_dim, t.num_key_value_heads, t.sliding_window, t.attention_bias) == (128, 4, None, True)
    assert (v.depth, v.embed_dim, v.hidden_size, v.in_channels, v.hidden_act) == (32, 1280, 3584, 3, "quick_gelu")
    assert cfg.image_token_id == 151655 and t.checkpoint_dtype == "bfloat16"


def test_transformers5_config_matches_released():
    d = HFConfig(**QWEN2_VL_7B).to_dict()
    assert "text_config" in d
    assert Qwen2VLConfig.from_hf_config(d).text == Qwen2VLConfig.from_hf_config(QWEN2_VL_7B).text


def test_missing_mrope_section_is_named():
    bad = {**QWEN2_VL_7B, "rope_scaling": {"type": "default"}}
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen2VLConfig.from_hf_config(bad)


def test_dummy_7b_shape_builds_abstractly():
    cfg = Qwen2VLConfig.from_hf_config(QWEN2_VL_7B)
    model = nnx.eval_shape(
        lambda: Qwen2VLForConditionalGeneration.build(
            cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention_fn=paged_attention, rngs=nnx.Rngs(0)
        )
    )
    count = lambda m: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    with torch.device("meta"):  # HF's model with shapes only: its parameter counts, exactly
        hf = HFModel(HFConfig(**QWEN2_VL_7B))
    assert count(model.visual) == sum(p.numel() for p in hf.model.visual.parameters()) == 675_759_104
    assert count(model) == sum(p.numel() for p in hf.parameters()) == 8_291_375_616  # Qwen2-VL-7B: 8.29 B

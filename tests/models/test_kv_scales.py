"""fp8 KV cache scales from a checkpoint (``self_attn.k_scale`` / ``v_scale`` / ``kv_scale``)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from engine_fixtures import checkpoint
from safetensors.numpy import load_file, save_file

from jaxserve.models.loader.kv_scales import read_kv_scales


def test_read_kv_scales_names_and_defaults():
    one = np.ones((), np.float32)
    tensors = {
        "model.layers.0.self_attn.k_scale": 0.5 * one, "model.layers.0.self_attn.v_scale": 2.0 * one,
        "model.layers.1.self_attn.kv_scale": np.array([3.0], np.float32),  # older: one for both
        "model.layers.2.self_attn.k_scale": 4.0 * one,  # V left at 1.0
        "model.layers.0.self_attn.q_proj.weight": np.zeros((2, 2), np.float32),
    }  # fmt: skip
    assert read_kv_scales(tensors) == {0: (0.5, 2.0), 1: (3.0, 3.0), 2: (4.0, 1.0)}
    assert read_kv_scales(iter(tensors.items())) == {}  # a stream (GGUF) has none
    with pytest.raises(ValueError, match=r"k_scale.*must be > 0"):
        read_kv_scales({"model.layers.0.self_attn.k_scale": np.zeros((), np.float32)})


def test_checkpoint_scales_reach_the_attention_layers(tmp_path):
    import jax.numpy as jnp

    from jaxserve.models.loader.hf import load_hf_model
    from jaxserve.pallas_kernels.attention import get_attention_fn

    src = checkpoint("llama_gqa")
    path = tmp_path / "with_scales"
    shutil.copytree(src, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = np.array(0.25, np.float32)
    tensors["model.layers.1.self_attn.v_scale"] = np.array(0.125, np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    model, _ = load_hf_model(str(path), dtype=jnp.float32, attention_fn=get_attention_fn("xla", "cpu"))
    layers = model.model.layers
    assert (layers[0].self_attn.k_scale, layers[0].self_attn.v_scale) == (1.0, 1.0)
    assert (layers[1].self_attn.k_scale, layers[1].self_attn.v_scale) == (0.25, 0.125)


def _with_scales(tmp_path) -> str:
    path = tmp_path / "with_scales"
    shutil.copytree(checkpoint("llama_gqa"), path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.self_attn.kv_scale"] = np.array(0.5, np.float32)
    tensors["model.layers.1.self_attn.k_scale"] = np.array(0.25, np.float32)
    tensors["model.layers.1.self_attn.v_scale"] = np.array(0.125, np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def test_scales_survive_orbax_conversion(tmp_path):
    """`jaxserve convert` keeps the scales (in jaxserve_checkpoint.json); the converted directory's model has them
    on the same layers as the source's, and an fp8 engine over it runs with them."""
    import json

    import jax.numpy as jnp
    from engine_fixtures import small_engine_kwargs

    from jaxserve import LLM
    from jaxserve.convert import convert
    from jaxserve.model_loader import load_model
    from jaxserve.models.loader.orbax_format import METADATA_FILE
    from jaxserve.pallas_kernels.attention import get_attention_fn

    src = _with_scales(tmp_path)
    out = str(tmp_path / "converted")
    convert(src, out)
    with open(os.path.join(out, METADATA_FILE)) as f:
        assert json.load(f)["kv_scales"] == {"0": [0.5, 0.5], "1": [0.25, 0.125]}
    attn = get_attention_fn("xla", "cpu")
    scales = []
    for path, fmt in ((src, "safetensors"), (out, "orbax")):
        model, _ = load_model(path, fmt, dtype=jnp.float32, attention_fn=attn)
        scales.append([(m.self_attn.k_scale, m.self_attn.v_scale) for m in model.model.layers])
    assert scales[0] == scales[1] == [(0.5, 0.5), (0.25, 0.125)]
    llm = LLM(out, **small_engine_kwargs(max_model_len=64, kv_cache_dtype="fp8", precompile="none"))
    assert llm.llm_engine.runner.kv_scales == scales[1]


def test_checkpoint_without_scales_converts_to_none(tmp_path):
    """A checkpoint without scales (and every older converted one, whose metadata has no kv_scales) reads as 1.0."""
    import json

    import jax.numpy as jnp

    from jaxserve.convert import convert
    from jaxserve.model_loader import load_model
    from jaxserve.models.loader.orbax_format import METADATA_FILE
    from jaxserve.pallas_kernels.attention import get_attention_fn

    out = str(tmp_path / "converted")
    convert(checkpoint("llama_gqa"), out)
    meta_path = os.path.join(out, METADATA_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["kv_scales"] == {}
    del meta["kv_scales"]  # as an older jaxserve wrote it
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    model, _ = load_model(out, "orbax", dtype=jnp.float32, attention_fn=get_attention_fn("xla", "cpu"))
    assert all((m.self_attn.k_scale, m.self_attn.v_scale) == (1.0, 1.0) for m in model.model.layers)


def test_gguf_has_no_scales_and_serves_fp8(tmp_path):
    """llama.cpp's GGUF files carry no per-layer KV scales: the model loads with 1.0 everywhere and an fp8 cache
    (or calculate_kv_scales) works over it."""
    pytest.importorskip("gguf")
    from engine_fixtures import small_engine_kwargs
    from tiny_gguf import write_gguf_from_hf

    from jaxserve import LLM, SamplingParams

    path = str(write_gguf_from_hf(checkpoint("llama_gqa"), tmp_path / "tiny.gguf"))
    kw = small_engine_kwargs(max_model_len=64, kv_cache_dtype="fp8", precompile="none", calculate_kv_scales=True)
    llm = LLM(path, **kw)
    assert llm.llm_engine.runner.kv_scales == [(1.0, 1.0)] * 2  # none in the file
    out = llm.generate([{"prompt_token_ids": [0, 5, 9, 200]}], SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 2
    assert all(0 < k < 1 and 0 < v < 1 for k, v in llm.llm_engine.runner.kv_scales)  # |K|, |V| < 448 here

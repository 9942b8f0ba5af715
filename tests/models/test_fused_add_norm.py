"""Residual adds fused into the norm after them on GPUs (models.layers.RMSNorm.add_and_norm).

A whole model step is lowered for "cuda" on this machine: that runs the kernel's real Triton lowering and shows
which kernels the GPU program holds. The kernel's numbers: tests/pallas_kernels/test_add_rms_norm.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_batch_utils import BLOCK_SIZE, NUM_BLOCKS, Chunk, block_tables, make_batch

from jaxserve.bench.decode_sass import triton_modules
from jaxserve.models.config import TextModelConfig
from jaxserve.models.layers import RMSNorm
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import get_attention_fn

LAYERS = 3


def _cuda_kernel_names(monkeypatch, mode: str | None) -> list[str]:
    """Names of the Triton kernels in a whole bf16 model step lowered for "cuda" (pallas attention)."""
    if mode is not None:
        monkeypatch.setenv("JAXSERVE_FUSED_ADD_NORM", mode)
    cfg = TextModelConfig(
        architecture="llama", vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = abstract_model(cfg, dtype=jnp.bfloat16, attention_fn=get_attention_fn("pallas", "gpu"))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
    table_a, table_b = block_tables(2)
    ids, md = make_batch([Chunk(list(range(2, 9)), 0, table_a), Chunk([5], 6, table_b)])
    page = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16)

    def step(state, caches, ids, md):
        hidden, caches = nnx.merge(graphdef, state)(ids, caches, md)
        return hidden, caches

    modules = triton_modules(jax.jit(step), state, [(page, page)] * LAYERS, ids, md)
    return [m.split("tt.func public @", 1)[1].split("(", 1)[0] for m in modules]


def test_a_gpu_step_fuses_every_residual_add_into_its_norm(monkeypatch):
    names = _cuda_kernel_names(monkeypatch, None)
    # Layer 0's input norm has no add before it; every other norm, the final one included, takes one.
    assert sum("add_rms_norm" in n for n in names) == 2 * LAYERS, names
    assert not any("add_rms_norm" in n for n in _cuda_kernel_names(monkeypatch, "never"))



def test_add_and_norm_off_the_gpu_is_the_plain_add_and_norm():
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16) for _ in range(2))
    norm = RMSNorm(64, eps=1e-6, param_dtype=jnp.float32)
    norm.scale[...] = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    s, n = jax.jit(norm.add_and_norm)(x, y)
    # Both jitted: XLA may keep the sum's excess precision inside a fusion (xla_allow_excess_precision).
    s_ref, n_ref = jax.jit(lambda x, y: (x + y, norm(x + y)))(x, y)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(n, np.float32), np.asarray(n_ref, np.float32))


def test_bad_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("JAXSERVE_FUSED_ADD_NORM", "yes")
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="JAXSERVE_FUSED_ADD_NORM='yes' is not one of auto, never"):
        RMSNorm(64, eps=1e-6, param_dtype=jnp.float32).add_and_norm(x, x)

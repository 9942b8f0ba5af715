"""A kernel attention under TP runs per device on its own heads (shard_map): same output, same cache,
and the cache keeps its kv-heads sharding. Checked with the jnp reference standing in for the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxserve import sharding
from jaxserve.pallas_kernels.attention import paged_attention
from jaxserve.pallas_kernels.random_batch import make_batch


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_attention_equals_unsharded(tp):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    mesh = sharding.replica_meshes(sharding.make_mesh(tp))[0]
    b = make_batch(np.random.default_rng(0), q_lens=[5, 1, 3], ctx_lens=[9, 6, 3], num_heads=8, num_kv_heads=4,
                   head_dim=16, block_size=4, dtype=jnp.float32, pad_tokens=3, pad_seqs=1)
    want = paged_attention(b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md, scale=0.25, sliding_window=4)

    def place(x, axes):
        return jax.device_put(x, NamedSharding(mesh, sharding.logical_spec(axes)))

    args = (place(b.q, sharding.Q_AXES), place(b.k_new, sharding.KV_NEW_AXES), place(b.v_new, sharding.KV_NEW_AXES),
            place(b.k_pages, sharding.KV_CACHE_AXES), place(b.v_pages, sharding.KV_CACHE_AXES))
    fn = jax.jit(lambda *a: sharding.shard_attention(paged_attention, mesh)(*a, b.md, scale=0.25, sliding_window=4))
    got = fn(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=0)
    cache_sharding = NamedSharding(mesh, sharding.logical_spec(sharding.KV_CACHE_AXES))
    assert got[1].sharding.is_equivalent_to(cache_sharding, 4) and got[2].sharding.is_equivalent_to(cache_sharding, 4)


def test_shard_attention_token_minor_v_splits_its_heads_axis(monkeypatch):
    """An fp8 cache with token-minor V pages [N, K, D, P] (kv_layout.py) under TP: the pallas backend
    (interpreted) per device equals it unsharded, and V stays split by its heads axis, now axis 1."""
    import functools

    from jaxserve.pallas_kernels import fp8, kv_layout
    from jaxserve.pallas_kernels.paged_attention_pallas import paged_attention_pallas

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    monkeypatch.setattr(kv_layout, "FP8_V_TOKEN_MINOR", True)
    mesh = sharding.replica_meshes(sharding.make_mesh(2))[0]
    b = make_batch(np.random.default_rng(1), q_lens=[5, 1, 1], ctx_lens=[9, 6, 13], num_heads=4, num_kv_heads=2,
                   head_dim=16, block_size=4, dtype=jnp.float32, pad_tokens=3, pad_seqs=1)  # fmt: skip
    k_pages = fp8.quantize(b.k_pages, 1.0, jnp.float8_e4m3fn)
    v_pages = kv_layout.to_token_minor(fp8.quantize(b.v_pages, 1.0, jnp.float8_e4m3fn))  # [N, K, D, P]
    attn = functools.partial(paged_attention_pallas, interpret=True)
    want = jax.jit(lambda *a: attn(*a, b.md, scale=0.25))(b.q, b.k_new, b.v_new, k_pages, v_pages)

    def place(x, axes):
        return jax.device_put(x, NamedSharding(mesh, sharding.logical_spec(axes)))

    args = (place(b.q, sharding.Q_AXES), place(b.k_new, sharding.KV_NEW_AXES), place(b.v_new, sharding.KV_NEW_AXES),
            place(k_pages, sharding.KV_CACHE_AXES), place(v_pages, sharding.V_CACHE_TOKEN_MINOR_AXES))  # fmt: skip
    got = jax.jit(lambda *a: sharding.shard_attention(attn, mesh)(*a, b.md, scale=0.25))(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    v_sharding = NamedSharding(mesh, sharding.logical_spec(sharding.V_CACHE_TOKEN_MINOR_AXES))
    assert got[2].sharding.is_equivalent_to(v_sharding, 4)
    assert v_sharding.spec[1] == "model"  # the heads axis of [N, K, D, P]

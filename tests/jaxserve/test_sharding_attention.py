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

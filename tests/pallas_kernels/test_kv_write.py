"""The GPU KV write (``kv_write``: Pallas row copies) against the reference scatter, in interpret mode on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import kv_write
from jaxserve.pallas_kernels.reference import write_kv

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,dtype",
    [(2, 64, jnp.float32), (8, 128, jnp.bfloat16), (3, 64, jnp.bfloat16)],  # K * D = 192: one head at a time
)
def test_write_matches_scatter(num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(0)
    n, p, t = 10, 16, 7  # T not a multiple of the tokens per program
    shape = (n, p, num_kv_heads, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, num_kv_heads, head_dim)), jnp.float32) for _ in range(2))
    # Five real slots, shuffled, and two padding tokens on the engine's out-of-range slot.
    slots = jnp.asarray([*rng.choice(n * p, t - 2, replace=False), n * p, n * p], jnp.int32)
    want = write_kv(k_pages, v_pages, k_new, v_new, slots)
    got = jax.jit(functools.partial(kv_write.write_kv_pallas, interpret=INTERPRET))(k_pages, v_pages, k_new, v_new, slots)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_supported_shapes():
    assert kv_write.supported(8, 128) and kv_write.supported(3, 64)
    assert not kv_write.supported(3, 96)  # then paged_attention_pallas falls back to the scatter

"""The reference KV write with a single token: right values, and still in place on a donated cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.reference import write_kv


@pytest.mark.parametrize("slot", [5, 10 * 16])  # a real slot, and the engine's dropped padding slot
def test_one_token_write_values(slot):
    rng = np.random.default_rng(0)
    shape = (10, 16, 3, 8)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.standard_normal((1, 3, 8)), jnp.float32) for _ in range(2))
    got_k, got_v = write_kv(k_pages, v_pages, k_new, v_new, jnp.asarray([slot], jnp.int32))
    for pages, new, got in ((k_pages, k_new, got_k), (v_pages, v_new, got_v)):
        want = np.asarray(pages).reshape(160, 3, 8).copy()
        if slot < 160:
            want[slot] = np.asarray(new[0])
        np.testing.assert_array_equal(np.asarray(got).reshape(160, 3, 8), want)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_write_into_a_donated_cache_copies_nothing(num_tokens):
    """XLA turns a one-row scatter in mode="drop" into a guarded dynamic-update-slice that copied the
    whole donated cache (3 copies per array, 10x a 1-token CPU step); write_kv must avoid it."""

    def step(k_pages, v_pages, k_new, v_new, slots):
        k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, slots)
        return k_pages, v_pages, k_pages[0, 0].sum() + v_pages[0, 0].sum()  # a read after the write

    shape = (64, 16, 3, 8)
    args = (jnp.zeros(shape), jnp.zeros(shape), jnp.ones((num_tokens, 3, 8)), jnp.ones((num_tokens, 3, 8)),
            jnp.arange(num_tokens, dtype=jnp.int32))  # fmt: skip
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    copied = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"f32\[([\d,]+)\]\S* copy\(", hlo)]
    assert max(copied, default=0) < np.prod(shape), copied  # no copy of a whole cache array

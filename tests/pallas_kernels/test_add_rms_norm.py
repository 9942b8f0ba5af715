"""The fused residual add + RMSNorm kernel (pallas_kernels/add_rms_norm.py), in interpret mode against
``RMSNorm`` applied to the sum (compiled for real on a GPU: ``JAX_PLATFORMS=cuda``). How a model step reaches it on a GPU: tests/models/test_fused_add_norm.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import RMSNorm
from jaxserve.pallas_kernels.add_rms_norm import add_rms_norm_pallas

INTERPRET = jax.default_backend() != "gpu"


def _inputs(t: int, d: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)) * 3, dtype)
    y = jnp.asarray(rng.standard_normal((t, d)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
    return x, y, w


def _reference(x, y, w, eps):
    norm = RMSNorm(x.shape[-1], eps=eps, param_dtype=jnp.float32)
    norm.scale[...] = w
    s = x + y
    return s, norm(s)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 96, 576])  # a power of two, and two that are not (SmolLM2's 576)
def test_kernel_matches_add_then_rms_norm(d, dtype):
    x, y, w = _inputs(7, d, dtype)
    s, n = add_rms_norm_pallas(x, y, w, eps=1e-5, interpret=INTERPRET)
    s_ref, n_ref = _reference(x, y, w, 1e-5)
    assert s.dtype == n.dtype == dtype and s.shape == n.shape == (7, d)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    # Only the float32 sum of squares may be ordered differently: a few units in the last place at most.
    tol = dict(rtol=5e-7, atol=0) if dtype == jnp.float32 else dict(rtol=2**-7, atol=0)
    np.testing.assert_allclose(np.asarray(n, np.float32), np.asarray(n_ref, np.float32), **tol)


def test_kernel_rejects_mismatched_shapes():
    x, y, w = _inputs(3, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"x \(3, 64\), y \(3, 32\)"):
        add_rms_norm_pallas(x, y[:, :32], w, eps=1e-5, interpret=INTERPRET)


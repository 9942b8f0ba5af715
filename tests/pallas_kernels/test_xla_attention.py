"""The 'xla' jnp backend (three routes: last tokens over pages, in-batch dense keys, a loop over cached
context) against the reference, which gathers every token's whole context."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import cpu_native
from jaxserve.pallas_kernels.attention import paged_attention as reference_backend
from jaxserve.pallas_kernels.kv_layout import to_heads_major
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.xla_attention import paged_attention_xla

TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}  # relative (Frobenius) error, as for the Pallas kernels


# The jnp routes, and the C++ kernel that replaces them (cpu_native.py) where this machine can build it.
NATIVE = [False, pytest.param(True, marks=pytest.mark.skipif(not cpu_native.available(), reason="no C++ kernel"))]


def xla_backend(q, k_new, v_new, k_pages, v_pages, md, **kw):
    """The backend over token-major pages (the batches' and the reference's): its own cache is heads-major
    [N, K, P, D], so the pages go in swapped and come back swapped."""
    fn = jax.jit(functools.partial(paged_attention_xla, **kw))
    out, k_out, v_out = fn(q, k_new, v_new, to_heads_major(k_pages), to_heads_major(v_pages), md)
    return out, to_heads_major(k_out), to_heads_major(v_out)


def _compare(batch, *, scale=0.1, sliding_window=None, dtype=jnp.float32, native=False):
    args = (batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md)
    with jax.default_matmul_precision("highest"):
        ref, k_ref, v_ref = reference_backend(*args, scale=scale, sliding_window=sliding_window)
        out, k_out, v_out = xla_backend(*args, scale=scale, sliding_window=sliding_window, native=native)
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))  # same KV write
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
    n = int(batch.md.query_start_loc[-1])
    out32, ref32 = np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]
    assert np.isfinite(out32).all()
    err = np.linalg.norm(out32 - ref32) / np.linalg.norm(ref32)
    assert err < TOL[dtype], f"relative error {err:.2e}"
    tok_err = np.abs(out32 - ref32).max(axis=(1, 2)) / (np.abs(ref32).max(axis=(1, 2)) + 1e-6)
    assert tok_err.max() < 20 * TOL[dtype], f"worst token {tok_err.argmax()} error {tok_err.max():.2e}"


# (num_heads, num_kv_heads, head_dim, dtype, block_size): GQA ratios 1, 4, 8, both head dims and dtypes.
SHAPES = [
    (4, 4, 64, jnp.float32, 8),
    (8, 2, 128, jnp.bfloat16, 16),
    (16, 2, 64, jnp.float32, 16),
    (8, 1, 128, jnp.float32, 32),
    (6, 2, 64, jnp.bfloat16, 16),
]


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("h,kh,d,dtype,p", SHAPES)
def test_mixed_batch_all_routes(h, kh, d, dtype, p, native):
    """Decodes, fresh prompts, a later prefill chunk and prefix-hit prompts (several loop iterations),
    query lengths 1 / block-boundary / odd, contexts from 1 to several blocks, padding tokens and seqs."""
    rng = np.random.default_rng(h * 100 + d + p)
    q_lens = [1, p, 7, 1, 2 * p + 3, 5, 1, 1]
    cached = [0, 0, 0, 3 * p + 1, 0, 2 * p, 5 * p - 1, 40]  # > 0 with q_len > 1: the loop route
    ctx_lens = [q + c for q, c in zip(q_lens, cached)]
    batch = make_batch(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=h, num_kv_heads=kh, head_dim=d, block_size=p,
        dtype=dtype, pad_tokens=5, pad_seqs=3,
    )  # fmt: skip
    _compare(batch, scale=d**-0.5, dtype=dtype, native=native)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_window(window, native):
    rng = np.random.default_rng(window)
    q_lens, ctx_lens = [1, 33, 9, 20], [70, 33, 50, 20]
    batch = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=jnp.float32, pad_tokens=3, pad_seqs=1)  # fmt: skip
    _compare(batch, sliding_window=window, native=native)


@pytest.mark.parametrize("native", NATIVE)
def test_only_decodes_and_only_prefills(native):
    rng = np.random.default_rng(1)
    for q_lens, ctx_lens in (([1] * 6, [1, 2, 17, 33, 64, 100]), ([12, 40, 3], [12, 40, 3])):
        batch = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                           block_size=16, dtype=jnp.float32, pad_tokens=4, pad_seqs=2)  # fmt: skip
        _compare(batch, native=native)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("num_seqs,pad_seqs", [(1, 0), (3, 2), (20, 4)])
def test_decode_only_path(num_seqs, pad_seqs, native):
    """AttentionMetadata.decode_only: route 1 alone (one chunk without a loop up to 16 sequences, the loop
    beyond), padding tokens zero, same as the reference."""
    import dataclasses

    rng = np.random.default_rng(num_seqs)
    ctx_lens = [int(c) for c in rng.integers(1, 90, num_seqs)]
    batch = make_batch(rng, q_lens=[1] * num_seqs, ctx_lens=ctx_lens, num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=jnp.float32, pad_tokens=3, pad_seqs=pad_seqs)  # fmt: skip
    batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, decode_only=True))
    _compare(batch, native=native)
    out, _, _ = xla_backend(batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md, scale=0.1,
                            native=native)
    np.testing.assert_array_equal(np.asarray(out)[num_seqs:], 0.0)


@pytest.mark.parametrize("native", NATIVE)
def test_nan_in_padding_rows_does_not_leak(native):
    """Padding rows of k_new/v_new are garbage (they can be NaN deep in a model); real tokens read this
    step's keys straight from k_new/v_new, so the padding rows must be masked out, not multiplied by 0."""
    rng = np.random.default_rng(2)
    q_lens, ctx_lens = [9, 1, 17], [20, 30, 17]
    batch = make_batch(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype=jnp.float32, pad_tokens=6, pad_seqs=1)  # fmt: skip
    n = sum(q_lens)
    poisoned = dict(k_new=batch.k_new.at[n:].set(jnp.nan), v_new=batch.v_new.at[n:].set(jnp.nan))
    out, _, _ = xla_backend(batch.q, poisoned["k_new"], poisoned["v_new"], batch.k_pages, batch.v_pages, batch.md,
                            scale=0.1, native=native)
    assert np.isfinite(np.asarray(out)[:n]).all()
    _compare(batch, native=native)

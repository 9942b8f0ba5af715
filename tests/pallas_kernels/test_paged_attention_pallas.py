"""Parity of the Pallas ragged paged attention (GPU kernels) with the jnp reference.

On CPU the kernels run in Pallas interpret mode, whose output buffers start NaN-filled: an element a
kernel forgets to write shows up as NaN. On a GPU the same tests compile the real kernels.
Every test draws fresh random inputs (shuffled block tables, noise in slots no sequence owns).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.attention import paged_attention as reference_backend
from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, paged_attention_pallas
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference, write_kv

INTERPRET = jax.default_backend() == "cpu"
# Relative (Frobenius) error bounds: bf16 operands land between 1e-3 and 1e-2; fp32 far under 1e-4.
TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}


def _run(batch, *, scale, sliding_window=None, config=None):
    fn = jax.jit(
        functools.partial(
            paged_attention_pallas, scale=scale, sliding_window=sliding_window, interpret=INTERPRET, config=config
        )
    )
    return fn(batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md)


def _check(batch, out, *, scale, sliding_window=None, dtype=jnp.float32):
    # XLA on GPU computes fp32 products in tf32 by default (~3e-4 error); the ground truth must not.
    with jax.default_matmul_precision("highest"):
        ref, _, _ = reference_backend(
            batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md,
            scale=scale, sliding_window=sliding_window,
        )  # fmt: skip
    n = int(batch.md.query_start_loc[-1])
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "unwritten (NaN) or non-finite output elements"
    err = np.linalg.norm(out32[:n] - ref32[:n]) / np.linalg.norm(ref32[:n])
    assert err < TOL[dtype], f"relative error {err:.2e}"
    # Per-token check too, so one wrong short sequence cannot hide behind a long correct one.
    tok_err = np.abs(out32[:n] - ref32[:n]).max(axis=(1, 2)) / (np.abs(ref32[:n]).max(axis=(1, 2)) + 1e-6)
    assert tok_err.max() < 20 * TOL[dtype], f"worst token {tok_err.argmax()} error {tok_err.max():.2e}"
    np.testing.assert_array_equal(out32[n:], 0.0)  # padding tokens come back as zeros


# (num_heads, num_kv_heads, head_dim, dtype, block_size): GQA ratios 1, 4, 8 (and a non-power-of-two 3),
# both head dims, both dtypes, small and large pages.
SHAPES = [
    (4, 4, 64, jnp.float32, 8),
    (8, 2, 128, jnp.bfloat16, 16),
    (16, 2, 64, jnp.bfloat16, 32),
    (8, 1, 128, jnp.float32, 16),
    (4, 1, 64, jnp.bfloat16, 128),
    (6, 2, 64, jnp.float32, 16),
]


@pytest.mark.parametrize("h,kh,d,dtype,p", SHAPES)
def test_mixed_ragged_batch(h, kh, d, dtype, p):
    rng = np.random.default_rng()
    # Decodes, a block-boundary chunk, odd chunks, a full prompt; contexts from 1 to several blocks.
    q_lens = [1, p, 7, 1, 3, 20]
    ctx_lens = [1, 2 * p, 7, 3 * p + 5, 4 * p + 1, 20]
    batch = make_batch(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=h, num_kv_heads=kh, head_dim=d, block_size=p,
        dtype=dtype, pad_tokens=5, pad_seqs=2, table_width=6,
    )  # fmt: skip
    scale = d**-0.5
    out, k_pages, v_pages = _run(batch, scale=scale)
    _check(batch, out, scale=scale, dtype=dtype)
    k_ref, v_ref = write_kv(batch.k_pages, batch.v_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(k_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(v_ref, np.float32))


@pytest.mark.parametrize("splits,heads_inner,tail_only", [(4, True, False), (3, False, False), (1, True, False), (3, True, True)])
def test_decode_only_long_context_split(splits, heads_inner, tail_only):
    """Pure decode with the context split in parts (the merge kernel must be exact), either grid order;
    with decode_mask_tail_only, a split's whole tiles run unmasked."""
    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[1, 1, 1, 2], ctx_lens=[97, 1, 64, 130], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=8, dtype=jnp.float32, pad_seqs=1,
    )  # fmt: skip
    cfg = GpuKernelConfig(
        decode_tile_tokens=16, decode_splits=splits, decode_heads_inner=heads_inner, decode_mask_tail_only=tail_only
    )
    out, _, _ = _run(batch, scale=0.125, config=cfg)
    _check(batch, out, scale=0.125)


@pytest.mark.parametrize("h,kh,d,dtype,p", SHAPES[:3])
def test_decode_only_variant_skips_prefill_and_agrees(h, kh, d, dtype, p):
    """The runner's pure-decode program (AttentionMetadata.decode_only): the decode kernel alone, same
    output as the reference, padding rows zero."""
    import dataclasses

    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[1, 1, 1], ctx_lens=[1, 3 * p + 5, 2 * p], num_heads=h, num_kv_heads=kh, head_dim=d,
        block_size=p, dtype=dtype, pad_tokens=5, pad_seqs=2, table_width=6,
    )  # fmt: skip
    batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, decode_only=True))
    out, _, _ = _run(batch, scale=d**-0.5)
    _check(batch, out, scale=d**-0.5, dtype=dtype)
    jaxpr = str(jax.make_jaxpr(functools.partial(paged_attention_pallas, scale=0.1, interpret=INTERPRET))(
        batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md
    ))
    assert "jaxserve_paged_decode" in jaxpr and "prefill" not in jaxpr  # no prefill kernel in the program


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_writes_only_its_rows_into_a_given_buffer(splits):
    """Given the prefill kernel's output buffer, the decode kernel writes its tokens' rows and no others."""
    from jaxserve.pallas_kernels.triton_decode import decode_attention

    rng = np.random.default_rng()
    q_lens, h, kh, d = [1, 9, 3, 1], 8, 2, 64
    batch = make_batch(
        rng, q_lens=q_lens, ctx_lens=[40, 20, 33, 7], num_heads=h, num_kv_heads=kh, head_dim=d, block_size=8,
        dtype=jnp.float32, pad_tokens=2,
    )  # fmt: skip
    t, qa = batch.q.shape[0], 4  # Gp = G = 4: up to 4 tokens per decode sequence
    q_p = jnp.pad(batch.q.reshape(t, kh, h // kh, d), ((0, qa), (0, 0), (0, 0), (0, 0)))
    sentinel = jnp.full((t + qa, kh, h // kh, d), 7.0, jnp.float32)
    md = batch.md
    fn = jax.jit(
        functools.partial(
            decode_attention, scale=0.125, q_per_seq=qa, tile_tokens=16, num_splits=splits, sliding_window=None,
            v_mask="where", num_warps=2, num_stages=2, interpret=INTERPRET,
        )
    )  # fmt: skip
    args = (q_p, batch.k_pages, batch.v_pages, md.query_start_loc, md.seq_lens, md.block_tables)
    out = np.asarray(fn(*args, out=sentinel))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(ragged_paged_attention_reference(batch.q, batch.k_pages, batch.v_pages, md, scale=0.125))
    ref = ref.reshape(t, kh, h // kh, d)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    decode_rows = np.zeros(t + qa, bool)
    for a, b in zip(starts[:-1], starts[1:]):
        decode_rows[a:b] = b - a <= qa
    np.testing.assert_allclose(out[decode_rows], ref[decode_rows[:t]], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out[~decode_rows], 7.0)


@pytest.mark.parametrize("v_mask", ["none", "load"])
def test_v_mask_modes(v_mask):
    """The other V-masking modes compute the same function on a clean cache (the default is "where")."""
    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[1, 6], ctx_lens=[21, 30], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=jnp.bfloat16, pad_tokens=1,
    )  # fmt: skip
    out, _, _ = _run(batch, scale=0.125, config=GpuKernelConfig(v_mask=v_mask))
    _check(batch, out, scale=0.125, dtype=jnp.bfloat16)


def test_chunked_prefill_over_long_context():
    """A later prefill chunk: whole unmasked tiles before the diagonal, masked ones on it."""
    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[37, 1, 16], ctx_lens=[150, 90, 64], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=8, dtype=jnp.bfloat16, pad_tokens=3,
    )  # fmt: skip
    cfg = GpuKernelConfig(prefill_tile_tokens=16, prefill_rows=32)
    out, _, _ = _run(batch, scale=0.125, config=cfg)
    _check(batch, out, scale=0.125, dtype=jnp.bfloat16)


def test_sliding_window():
    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[1, 9, 24], ctx_lens=[50, 40, 24], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=8, dtype=jnp.float32,
    )  # fmt: skip
    out, _, _ = _run(batch, scale=0.125, sliding_window=13)
    _check(batch, out, scale=0.125, sliding_window=13)


def test_stale_nan_slots_do_not_leak():
    """Slots no sequence owns hold NaN (a reused page's leftovers): masked reads must not propagate it."""
    rng = np.random.default_rng()
    kw = dict(q_lens=[1, 5, 2], ctx_lens=[11, 21, 3], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8)
    poisoned = make_batch(rng, **kw, dtype=jnp.float32, stale_value=float("nan"))
    out, _, _ = _run(poisoned, scale=0.125)
    # The reference multiplies masked NaNs by zero probabilities (NaN), so compare on a NaN-free copy.
    clean = poisoned.__class__(**{**poisoned.__dict__})
    clean.k_pages = jnp.nan_to_num(poisoned.k_pages)
    clean.v_pages = jnp.nan_to_num(poisoned.v_pages)
    _check(clean, out, scale=0.125)


def test_drop_in_under_jit_with_donated_cache():
    """Called as the engine calls it: inside jit, cache donated, shapes static, output cache returned."""
    rng = np.random.default_rng()
    batch = make_batch(
        rng, q_lens=[1, 4], ctx_lens=[9, 4], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=jnp.float32, pad_tokens=2,
    )  # fmt: skip
    step = jax.jit(
        functools.partial(paged_attention_pallas, scale=0.125, interpret=INTERPRET), donate_argnums=(3, 4)
    )
    k_ref, v_ref = write_kv(batch.k_pages, batch.v_pages, batch.k_new, batch.v_new, batch.md.slot_mapping)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(batch.q, k_ref, v_ref, batch.md, scale=0.125)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")  # CPU cannot donate
        out, k_pages, v_pages = step(batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md)
    assert k_pages.shape == v_pages.shape == batch.k_pages.shape
    np.testing.assert_allclose(np.asarray(out[:5]), np.asarray(ref[:5]), rtol=1e-5, atol=1e-5)

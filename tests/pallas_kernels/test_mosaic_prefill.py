"""The Mosaic GPU (Hopper) prefill kernel: parity with the jnp reference through the engine's entry point.

On CPU it runs under Pallas's Mosaic GPU interpreter, which runs the warpgroups as threads and checks
the barrier protocol (a barrier phase completing twice before anyone saw it, or one left unobserved,
fails the test); there the two wgmma products are plain dots, since the interpreter takes no
transposed operand. On an H100/H200 the same test compiles the real kernel, and the decode kernel then
writes into the prefill kernel's output buffer. One batch covers the cases: two query blocks (the
second with rows for one warpgroup only: the row-ladder store, the other warpgroup only releasing
tiles), a short prompt, a chunk late in a long context, decodes beside them, padding, and NaN in every
slot no sequence owns (V must be zeroed past a sequence's end).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import mosaic_prefill
from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, paged_attention_pallas
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference, write_kv

INTERPRET = jax.default_backend() == "cpu"


def _skip_reason(**kw):
    kw = {"head_dim": 64, "dtype": jnp.bfloat16, "page_size": 16, "block_kv": 64, "sliding_window": None, **kw}
    return mosaic_prefill.unsupported_reason(interpret=INTERPRET, **kw)


def test_unsupported_shapes_fall_back():
    assert _skip_reason(dtype=jnp.float32) is not None
    assert _skip_reason(sliding_window=8) is not None
    assert _skip_reason(head_dim=96) is not None
    assert _skip_reason(page_size=12) is not None
    assert _skip_reason(head_dim=128, block_kv=128, stages=4) is not None  # over the shared memory
    assert _skip_reason(head_dim=128, block_kv=128, stages=3, q_smem=True) is not None
    assert _skip_reason(head_dim=128, block_kv=128, stages=2) == _skip_reason()


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
@pytest.mark.parametrize("pingpong,q_smem,stages", [(False, False, 2), (True, False, 3), (True, True, 2)])
def test_mosaic_prefill_matches_reference(pingpong, q_smem, stages):
    rng = np.random.default_rng()
    q_lens = [1, 133, 6, 2, 70]
    ctx_lens = [9, 150, 6, 40, 300]
    batch = make_batch(
        rng, q_lens=q_lens, ctx_lens=ctx_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=jnp.bfloat16, pad_tokens=3, stale_value=float("nan"),
    )  # fmt: skip
    cfg = GpuKernelConfig(
        prefill_impl="mosaic", mosaic_block_kv=64, mosaic_stages=stages, mosaic_pingpong=pingpong, mosaic_q_smem=q_smem
    )
    fn = jax.jit(functools.partial(paged_attention_pallas, scale=0.125, interpret=INTERPRET, config=cfg))
    out, _, _ = fn(batch.q, batch.k_new, batch.v_new, batch.k_pages, batch.v_pages, batch.md)

    # The reference multiplies masked NaNs by zero probabilities (NaN): compare on a NaN-free cache
    # holding this step's writes.
    clean_k, clean_v = (jnp.nan_to_num(p) for p in (batch.k_pages, batch.v_pages))
    clean_k, clean_v = write_kv(clean_k, clean_v, batch.k_new, batch.v_new, batch.md.slot_mapping)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(batch.q, clean_k, clean_v, batch.md, scale=0.125)
    n = sum(q_lens)
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out32).all(), "unwritten (NaN) or non-finite output elements"
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    for s, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        err = np.linalg.norm(out32[a:b] - ref32[a:b]) / np.linalg.norm(ref32[a:b])
        assert err < 2e-2, f"sequence {s} (q_len {q_lens[s]}): relative error {err:.2e}"
    np.testing.assert_array_equal(out32[n:], 0.0)

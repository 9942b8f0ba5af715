"""The TPU path: jaxserve's cache and metadata mapped onto jax's ragged_paged_attention op.

The layout mapping is checked through the op's own pure-jnp reference (``ref_ragged_paged_attention``),
which reads exactly the inputs the Pallas TPU kernel would. Running the kernel itself on CPU needs
Pallas's TPU interpreter; where the installed jax's interpreter cannot run this op (jax 0.10.2 fails on
its reshaped refs), that test is skipped with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.paged_attention_pallas import paged_attention_pallas
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference, write_kv
from jaxserve.pallas_kernels.tpu_ragged_adapter import tpu_op_inputs


def _batch(dtype=jnp.float32):
    return make_batch(
        np.random.default_rng(), q_lens=[1, 5, 16], ctx_lens=[9, 21, 16], num_heads=8, num_kv_heads=2,
        head_dim=128, block_size=16, dtype=dtype, pad_tokens=2, pad_seqs=1,
    )  # fmt: skip


def test_layout_mapping_matches_reference():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    b = _batch()
    k_pages, v_pages = write_kv(b.k_pages, b.v_pages, b.k_new, b.v_new, b.md.slot_mapping)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(b.q, k_pages, v_pages, b.md, scale=0.1)
        out = ref_ragged_paged_attention(b.q, *tpu_op_inputs(k_pages, v_pages, b.md), sm_scale=0.1)
    n = int(b.md.query_start_loc[-1])  # the op's reference returns only the real tokens
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref[:n]), rtol=1e-4, atol=1e-4)


def test_tpu_kernel_in_interpreter():
    b = _batch()
    try:
        out, _, _ = paged_attention_pallas(
            b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md, scale=0.1, platform="tpu", interpret=True
        )
        out.block_until_ready()
    except Exception as e:  # noqa: BLE001 - only the interpreter's known gap is skipped
        if "ReshapeTransform" in str(e):
            pytest.skip(f"jax {jax.__version__}'s TPU interpreter cannot run ragged_paged_attention: {e!s:.120}")
        raise
    k_pages, v_pages = write_kv(b.k_pages, b.v_pages, b.k_new, b.v_new, b.md.slot_mapping)
    ref = ragged_paged_attention_reference(b.q, k_pages, v_pages, b.md, scale=0.1)
    n = int(b.md.query_start_loc[-1])
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref[:n]), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cache_through_the_adapter_matches_reference(fmt, monkeypatch):
    """An fp8 cache through the TPU path: the adapter's write quantizes with the layer's scales, and what the op
    reads (its pure-jnp reference stands in for the kernel, given the adapter's exact arguments) equals jaxserve's
    reference over the same fp8 cache, with the traced scales folded outside the op."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_kernel

    from jaxserve.pallas_kernels import fp8
    from jaxserve.pallas_kernels.tpu_ragged_adapter import ragged_paged_attention_tpu

    dtype = fp8.kv_cache_dtype_for(fmt, jnp.float32)
    b = _batch()
    k0, v0 = fp8.quantize(b.k_pages, 0.5, dtype), fp8.quantize(b.v_pages, 2.0, dtype)
    calls = []

    def op(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw):
        calls.append(kw)
        assert kv_pages.dtype == dtype  # the op reads the fp8 pages, not a dequantized copy
        kw = {k: v for k, v in kw.items() if k in ("sm_scale", "sliding_window", "k_scale", "v_scale")}
        out = tpu_kernel.ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
        return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))

    monkeypatch.setattr(tpu_kernel, "ragged_paged_attention", op)
    monkeypatch.setattr("jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention", op)
    ks, vs = jnp.float32(0.5), jnp.float32(2.0)  # traced-like scales: arrays, as the model passes them
    with jax.default_matmul_precision("highest"):
        # Eager: the op's reference loops over a concrete sequence count.
        out, k_pages, v_pages = ragged_paged_attention_tpu(
            b.q, b.k_new, b.v_new, k0, v0, b.md, scale=0.1, k_scale=ks, v_scale=vs
        )
        ref = ragged_paged_attention_reference(b.q, k_pages, v_pages, b.md, scale=0.1, k_scale=ks, v_scale=vs)
    assert calls and calls[0]["k_scale"] == 1.0 and calls[0]["v_scale"] == 1.0
    # The real op's own checks accept these fp8 inputs (its kernel needs a TPU, or an interpreter newer than 0.10's).
    op_args = tpu_op_inputs(k_pages, v_pages, b.md)
    tpu_kernel.static_validate_inputs(b.q, *op_args, sm_scale=0.1, k_scale=1.0, v_scale=1.0)
    tpu_kernel.get_min_heads_per_blk(b.q.shape[1], op_args[0].shape[2], b.q.dtype, dtype)
    assert k_pages.dtype == v_pages.dtype == dtype
    exp_k, exp_v = write_kv(k0, v0, b.k_new, b.v_new, b.md.slot_mapping, ks, vs)
    np.testing.assert_array_equal(np.asarray(k_pages, np.float32), np.asarray(exp_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32), np.asarray(exp_v, np.float32))
    n = int(b.md.query_start_loc[-1])
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(ref[:n]), rtol=1e-4, atol=1e-4)


def test_fp8_cache_with_odd_kv_heads_refused_clearly():
    from jaxserve.pallas_kernels import fp8
    from jaxserve.pallas_kernels.tpu_ragged_adapter import ragged_paged_attention_tpu

    b = make_batch(
        np.random.default_rng(0), q_lens=[1], ctx_lens=[5], num_heads=2, num_kv_heads=1, head_dim=128, block_size=16
    )
    k = fp8.quantize(b.k_pages, 1.0, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="even number of KV heads per device.*has 1: use kv_cache_dtype='auto'"):
        ragged_paged_attention_tpu(b.q, b.k_new, b.v_new, k, k, b.md, scale=0.1)

"""The Mosaic GPU decode kernel over fp8 caches (pallas_kernels/mosaic_decode.py), interpreted on CPU (and run
on Hopper when there is one): against the float32 reference over the same fp8 cache, alone and as the pallas
backend's decode kernel in a mixed step."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import fp8, mosaic_decode
from jaxserve.pallas_kernels.attention import paged_attention as reference_backend
from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, paged_attention_pallas
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference

INTERPRET = jax.default_backend() == "cpu"
H, KH, D, P = 8, 2, 128, 16  # head size 128: the kernel's; 4 query heads per KV head as in Llama-3-8B


def _skip_unless_runnable(kv_dtype=jnp.float8_e4m3fn):
    reason = mosaic_decode.unsupported_reason(
        head_dim=D, q_dtype=jnp.bfloat16, kv_dtype=kv_dtype, page_size=P, rows=16, sliding_window=None,
        interpret=INTERPRET,
    )  # fmt: skip
    if reason is not None:
        pytest.skip(reason)


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("block_kv,stages,qa", [(64, 3, 4), (128, 2, 4), (128, 2, 8)])
def test_decode_kernel_agrees_with_reference(dtype, block_kv, stages, qa):
    """Decodes over contexts of 1 token, partial tiles and whole tiles, a 3-token verify step, a padding
    sequence; a stale NaN in a reused page past a sequence's end must not leak. qa: new tokens a sequence
    may have (rows = qa x 4 heads: the wgmma's N, 16 or 32)."""
    _skip_unless_runnable(dtype)
    rng = np.random.default_rng(7)
    q_lens, ctx = [1, 1, 1, 3 if qa == 4 else 6, 1], [70, 1, 200, 64, 130]
    b = make_batch(
        rng, q_lens=q_lens, ctx_lens=ctx, num_heads=H, num_kv_heads=KH, head_dim=D, block_size=P,
        dtype=jnp.float32, pad_tokens=2, pad_seqs=1,
    )  # fmt: skip
    k, v = fp8.quantize(b.k_pages, 1.0, dtype), fp8.quantize(b.v_pages, 1.0, dtype)
    # A NaN in the slot right after sequence 0's last token (its page is the sequence's own); the reference
    # reads the clean cache (it would propagate the NaN: it masks nothing of V).
    page, slot = b.md.block_tables[0, 70 // P], 70 % P
    v_stale = v.at[page, slot].set(jnp.nan)
    t, g = b.q.shape[0], H // KH
    q = b.q.astype(jnp.bfloat16)
    q_p = jnp.pad(q.reshape(t, KH, g, D), ((0, qa), (0, 0), (0, 0), (0, 0)))
    cfg = mosaic_decode.MosaicDecodeConfig(stages=stages, block_kv=block_kv)
    fn = jax.jit(functools.partial(
        mosaic_decode.decode_attention_mosaic, scale=D**-0.5, q_per_seq=qa, config=cfg, interpret=INTERPRET
    ))  # fmt: skip
    out = fn(q_p, k, v_stale, b.md.query_start_loc, b.md.seq_lens, b.md.block_tables, b.md.token_seq_ids)
    with jax.default_matmul_precision("highest"):
        ref = ragged_paged_attention_reference(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), b.md, scale=D**-0.5
        )  # fmt: skip
    n = int(b.md.query_start_loc[-1])
    assert _rel_err(out.reshape(t, H, D)[:n], ref[:n]) < 5e-3


def test_pallas_backend_with_mosaic_decode_agrees_on_a_mixed_step():
    """decode_impl="mosaic": a prefill chunk (Triton prefill) beside decodes (this kernel), scales folded,
    KV written by the backend; the same output as the reference within bf16's tolerance."""
    _skip_unless_runnable()
    rng = np.random.default_rng(3)
    k_scale, v_scale, dtype = 0.5, 2.0, jnp.float8_e4m3fn
    q_lens, cached = [1, 21, 1, 3], [9, 0, 150, 17]
    b = make_batch(
        rng, q_lens=q_lens, ctx_lens=[q + c for q, c in zip(q_lens, cached)], num_heads=H, num_kv_heads=KH,
        head_dim=D, block_size=P, dtype=jnp.float32, pad_tokens=2, pad_seqs=1,
    )  # fmt: skip
    b = dataclasses.replace(
        b, q=b.q.astype(jnp.bfloat16), k_new=b.k_new.astype(jnp.bfloat16), v_new=b.v_new.astype(jnp.bfloat16),
        k_pages=fp8.quantize(b.k_pages, k_scale, dtype), v_pages=fp8.quantize(b.v_pages, v_scale, dtype),
    )  # fmt: skip
    args = (b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md)
    with jax.default_matmul_precision("highest"):
        ref, _, _ = reference_backend(*args, scale=D**-0.5, k_scale=k_scale, v_scale=v_scale)
    cfg = GpuKernelConfig(decode_impl="mosaic", prefill_impl="triton")
    fn = jax.jit(functools.partial(paged_attention_pallas, scale=D**-0.5, interpret=INTERPRET, config=cfg))
    out, _, _ = fn(*args, k_scale=k_scale, v_scale=v_scale)
    n = int(b.md.query_start_loc[-1])
    assert _rel_err(out[:n], ref[:n]) < 2e-2
    jaxpr = str(jax.make_jaxpr(fn)(*args, k_scale=k_scale, v_scale=v_scale))
    assert "jaxserve_paged_decode" not in jaxpr  # the Triton decode kernel is not in the program


def test_mosaic_decode_refusals_say_what_to_use():
    """Asked for where it cannot run, it says why and what to use; bf16 caches keep the Triton kernel."""
    rng = np.random.default_rng(0)
    b = make_batch(rng, q_lens=[1], ctx_lens=[20], num_heads=H, num_kv_heads=KH, head_dim=64, block_size=P)
    k, v = fp8.quantize(b.k_pages, 1.0, jnp.float8_e4m3fn), fp8.quantize(b.v_pages, 1.0, jnp.float8_e4m3fn)
    cfg = GpuKernelConfig(decode_impl="mosaic")
    with pytest.raises(ValueError, match=r"decode_impl='mosaic' cannot run here: head_dim 64.*use decode_impl='auto' or 'triton'"):
        paged_attention_pallas(b.q.astype(jnp.bfloat16), b.k_new, b.v_new, k, v, b.md, scale=0.1, interpret=True,
                               config=cfg)  # fmt: skip
    with pytest.raises(ValueError, match="decode_impl='cuda'"):
        paged_attention_pallas(b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md, scale=0.1, interpret=True,
                               config=GpuKernelConfig(decode_impl="cuda"))  # fmt: skip


def test_mosaic_decode_is_head_local_as_tensor_parallelism_needs():
    """TP runs the kernel per device on its own KV heads (``sharding.shard_attention``, tested with the
    reference in tests/jaxserve/test_sharding_attention.py): each half of the heads, run alone, gives that half
    of the whole run's output. (Not run through shard_map here: the Mosaic GPU interpreter on several host
    devices at once can stall.)"""
    _skip_unless_runnable()
    b = make_batch(np.random.default_rng(5), q_lens=[1, 1, 2], ctx_lens=[40, 150, 9], num_heads=H, num_kv_heads=KH,
                   head_dim=D, block_size=P, dtype=jnp.bfloat16, pad_tokens=3, pad_seqs=1)  # fmt: skip
    k_pages = fp8.quantize(b.k_pages, 1.0, jnp.float8_e4m3fn)
    v_pages = fp8.quantize(b.v_pages, 1.0, jnp.float8_e4m3fn)
    cfg = GpuKernelConfig(decode_impl="mosaic", prefill_impl="triton")
    fn = jax.jit(functools.partial(paged_attention_pallas, scale=D**-0.5, interpret=INTERPRET, config=cfg))
    whole, k_all, v_all = fn(b.q, b.k_new, b.v_new, k_pages, v_pages, b.md)
    n, hh, kk = int(b.md.query_start_loc[-1]), H // 2, KH // 2
    for part in range(2):
        qs, ks = slice(part * hh, (part + 1) * hh), slice(part * kk, (part + 1) * kk)
        out, k_part, v_part = fn(b.q[:, qs], b.k_new[:, ks], b.v_new[:, ks], k_pages[:, :, ks], v_pages[:, :, ks], b.md)
        np.testing.assert_array_equal(np.asarray(out, np.float32)[:n], np.asarray(whole[:, qs], np.float32)[:n])
        np.testing.assert_array_equal(np.asarray(k_part, np.float32), np.asarray(k_all[:, :, ks], np.float32))

"""fp8 KV cache in the jnp backends: the write rounds (scale, clamp), the readers scale back, and the xla
backend agrees with the reference over fp8 caches of both formats."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import fp8
from jaxserve.pallas_kernels.attention import paged_attention as reference_backend
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import write_kv
from jaxserve.pallas_kernels.kv_layout import to_heads_major
from jaxserve.pallas_kernels.xla_attention import paged_attention_xla

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("dtype", FORMATS)
def test_write_then_read_round_trip_with_scales_and_clamping(dtype):
    """A slot reads back as fp8(x / scale) * scale; values past the range clamp to +-max * scale, never
    inf or NaN (a plain cast would give NaN in e4m3fn, inf in e5m2)."""
    n, p, kh, d = 4, 8, 2, 16
    big = float(jnp.finfo(dtype).max)
    k_scale, v_scale = 0.5, 4.0
    rng = np.random.default_rng(0)
    k_new = rng.standard_normal((3, kh, d)).astype(np.float32) * 3
    v_new = rng.standard_normal((3, kh, d)).astype(np.float32) * 3
    k_new[1, 0, :4] = [10 * big, -10 * big, big * k_scale * 1.01, np.float32(3e38)]  # past the range
    slots = jnp.asarray([5, 17, 30], jnp.int32)
    pages = jnp.zeros((n, p, kh, d), dtype)
    k_pages, v_pages = write_kv(pages, pages, jnp.asarray(k_new), jnp.asarray(v_new), slots, k_scale, v_scale)
    assert k_pages.dtype == dtype and v_pages.dtype == dtype
    k_read = np.asarray(fp8.dequantize(k_pages, k_scale)).reshape(n * p, kh, d)[np.asarray(slots)]
    v_read = np.asarray(fp8.dequantize(v_pages, v_scale)).reshape(n * p, kh, d)[np.asarray(slots)]
    assert np.isfinite(k_read).all() and np.isfinite(v_read).all()
    with np.errstate(over="ignore"):  # 3e38 / 0.5 is inf, which must clamp as well
        want_k = np.clip(k_new / k_scale, -big, big).astype(dtype).astype(np.float32) * k_scale
    want_v = np.clip(v_new / v_scale, -big, big).astype(dtype).astype(np.float32) * v_scale
    np.testing.assert_array_equal(k_read, want_k)
    np.testing.assert_array_equal(v_read, want_v)
    np.testing.assert_array_equal(k_read[1, 0, :4], [big * k_scale, -big * k_scale, big * k_scale, big * k_scale])
    # fp8 rounding: relative error within half an ulp of the format (2^-4 for e4m3, 2^-3 for e5m2)
    eps = float(jnp.finfo(dtype).eps)
    ok = np.abs(k_new) < big * k_scale
    assert (np.abs(k_read - k_new)[ok] <= eps / 2 * np.abs(k_new)[ok] + 1e-6).all()


def _fp8_batch(dtype, k_scale, v_scale, seed=0):
    """A mixed batch (decodes, fresh prompts, later chunks, prefix hits, padding) over an fp8 cache."""
    rng = np.random.default_rng(seed)
    p = 8
    q_lens = [1, p, 7, 1, 2 * p + 3, 5, 1]
    cached = [0, 0, 0, 3 * p + 1, 0, 2 * p, 40]
    b = make_batch(
        rng, q_lens=q_lens, ctx_lens=[q + c for q, c in zip(q_lens, cached)], num_heads=8, num_kv_heads=2,
        head_dim=64, block_size=p, dtype=jnp.float32, pad_tokens=3, pad_seqs=2,
    )  # fmt: skip
    return dataclasses.replace(
        b, k_pages=fp8.quantize(b.k_pages, k_scale, dtype), v_pages=fp8.quantize(b.v_pages, v_scale, dtype)
    )


@pytest.mark.parametrize("dtype", FORMATS)
def test_reference_reads_fp8_as_its_dequantized_values(dtype):
    """The reference over an fp8 cache equals the float32 reference over the dequantized cache and the
    fp8-rounded new keys: what the cache holds, scales applied, is all the attention sees."""
    k_scale, v_scale = 0.25, 2.0
    b = _fp8_batch(dtype, k_scale, v_scale)
    scale = 64**-0.5
    with jax.default_matmul_precision("highest"):
        out, k_pages, v_pages = reference_backend(
            b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md, scale=scale, k_scale=k_scale, v_scale=v_scale
        )
        rt = lambda x, s: fp8.dequantize(fp8.quantize(x, s, dtype), s)  # noqa: E731
        want, _, _ = reference_backend(
            b.q, rt(b.k_new, k_scale), rt(b.v_new, v_scale), fp8.dequantize(b.k_pages, k_scale),
            fp8.dequantize(b.v_pages, v_scale), b.md, scale=scale,
        )  # fmt: skip
    n = int(b.md.query_start_loc[-1])
    assert k_pages.dtype == dtype
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(want)[:n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", FORMATS)
def test_xla_backend_agrees_with_reference_on_fp8(dtype):
    k_scale, v_scale = 0.5, 1.5
    b = _fp8_batch(dtype, k_scale, v_scale, seed=1)
    args = (b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md)
    kw = dict(scale=64**-0.5, k_scale=k_scale, v_scale=v_scale)
    with jax.default_matmul_precision("highest"):
        ref, k_ref, v_ref = reference_backend(*args, **kw)
        hm = (b.q, b.k_new, b.v_new, to_heads_major(b.k_pages), to_heads_major(b.v_pages), b.md)  # its cache's layout
        out, k_out, v_out = jax.jit(functools.partial(paged_attention_xla, scale=kw["scale"]))(
            *hm, k_scale=k_scale, v_scale=v_scale
        )
        k_out, v_out = to_heads_major(k_out), to_heads_major(v_out)  # back to [N, P, K, D]
    assert k_out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))  # same write
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
    n = int(b.md.query_start_loc[-1])
    out32, ref32 = np.asarray(out)[:n], np.asarray(ref)[:n]
    assert np.isfinite(out32).all()
    assert np.linalg.norm(out32 - ref32) / np.linalg.norm(ref32) < 1e-5


def test_kv_cache_dtype_names():
    assert fp8.kv_cache_dtype_for("auto", jnp.bfloat16) == jnp.bfloat16
    assert fp8.kv_cache_dtype_for("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert fp8.kv_cache_dtype_for("fp8_e4m3", jnp.float32) == jnp.float8_e4m3fn
    assert fp8.kv_cache_dtype_for("fp8-e5m2", jnp.float32) == jnp.float8_e5m2


# (num_heads, num_kv_heads, head_dim, q dtype): bf16 as served on GPU, float32 as on CPU.
PALLAS_CASES = [(8, 2, 64, jnp.bfloat16), (4, 4, 32, jnp.float32)]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("h,kh,d,q_dtype", PALLAS_CASES)
def test_pallas_kernels_agree_with_reference_on_fp8(dtype, h, kh, d, q_dtype):
    """The GPU path (Pallas KV write, Triton decode and prefill kernels; interpreted on CPU) over an fp8
    cache: same bytes written as the reference, same attention within the query dtype's tolerance."""
    from jaxserve.pallas_kernels.paged_attention_pallas import paged_attention_pallas

    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(h + d)
    p, k_scale, v_scale = 8, 0.5, 2.0
    q_lens, cached = [1, 1, 21, 3, 1], [9, 30, 0, 17, 2]  # 21 > 16 tokens: the prefill kernel
    b = make_batch(
        rng, q_lens=q_lens, ctx_lens=[q + c for q, c in zip(q_lens, cached)], num_heads=h, num_kv_heads=kh,
        head_dim=d, block_size=p, dtype=jnp.float32, pad_tokens=2, pad_seqs=1,
    )  # fmt: skip
    b = dataclasses.replace(
        b, q=b.q.astype(q_dtype), k_new=b.k_new.astype(q_dtype), v_new=b.v_new.astype(q_dtype),
        k_pages=fp8.quantize(b.k_pages, k_scale, dtype), v_pages=fp8.quantize(b.v_pages, v_scale, dtype),
    )  # fmt: skip
    args = (b.q, b.k_new, b.v_new, b.k_pages, b.v_pages, b.md)
    with jax.default_matmul_precision("highest"):
        ref, k_ref, v_ref = reference_backend(*args, scale=d**-0.5, k_scale=k_scale, v_scale=v_scale)
    fn = jax.jit(functools.partial(paged_attention_pallas, scale=d**-0.5, interpret=interpret))
    out, k_out, v_out = fn(*args, k_scale=k_scale, v_scale=v_scale)
    assert k_out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
    n = int(b.md.query_start_loc[-1])
    out32, ref32 = np.asarray(out, np.float32)[:n], np.asarray(ref, np.float32)[:n]
    assert np.isfinite(out32).all()
    err = np.linalg.norm(out32 - ref32) / np.linalg.norm(ref32)
    assert err < (2e-2 if q_dtype == jnp.bfloat16 else 1e-5), f"relative error {err:.2e}"

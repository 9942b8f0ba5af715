"""The C++ decode-attention kernel (cpu_native.py, cpu_decode_attention.cc): built, called from jit, equal to the
jnp route it replaces, and left alone where it does not apply (switched off, no compiler, fp8 caches, TP)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import attention, cpu_native
from jaxserve.pallas_kernels.xla_attention import paged_attention_xla

needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="no C++ compiler to build the kernel")


def _route_one(q, k_pages, v_pages, tables, lens, scale, window):
    """Each sequence's query rows over its gathered pages, masked: the jnp definition (float64 on the host)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32)))
    s, kh, g, d = q.shape
    p = k.shape[2]
    out = np.zeros_like(q)
    for i in range(s):
        n = int(lens[i])
        pos = np.arange(n)
        keep = pos >= n - window if window is not None else pos >= 0
        blocks = np.asarray(tables[i])[pos // p]
        ks, vs = k[blocks, :, pos % p][keep], v[blocks, :, pos % p][keep]  # [C, K, D]
        if not len(ks):
            continue
        sc = np.einsum("kgd,ckd->kgc", q[i], ks) * scale
        w = np.exp(sc - sc.max(-1, keepdims=True))
        out[i] = np.einsum("kgc,ckd->kgd", w, vs) / w.sum(-1)[..., None]
    return out


@needs_kernel
@pytest.mark.parametrize("kh,g,d,p,dtype,window", [
    (3, 3, 64, 16, jnp.float32, None),  # SmolLM2-135M's widths
    (2, 4, 128, 16, jnp.float32, None),
    (1, 8, 32, 8, jnp.float32, None),  # a head size with no specialised path
    (4, 1, 64, 32, jnp.bfloat16, None),
    (2, 2, 64, 16, jnp.float32, 5),
    (2, 2, 80, 16, jnp.bfloat16, 40),
])  # fmt: skip
def test_kernel_equals_route_one(kh, g, d, p, dtype, window):
    rng = np.random.default_rng(kh * 1000 + g * 100 + d + p)
    n_blocks, b = 40, 6
    lens = np.array([1, p, p + 1, 0, b * p, 37], np.int32)  # a padding row (0) among them
    tables = rng.permutation(n_blocks)[: len(lens) * b].reshape(len(lens), b).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), kh, g, d)), jnp.float32)
    k_pages = jnp.asarray(rng.standard_normal((n_blocks, kh, p, d)) * 2, dtype)
    v_pages = jnp.asarray(rng.standard_normal((n_blocks, kh, p, d)), dtype)
    fn = jax.jit(functools.partial(cpu_native.decode_attention, scale=d**-0.5, sliding_window=window))
    out = np.asarray(fn(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lens)))
    want = _route_one(q, k_pages, v_pages, tables, lens, d**-0.5, window)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(out[3], 0.0)  # the padding row


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_call_split_over_threads(dtype):
    """A call that reads megabytes of K and V is split over XLA's threads in parts of about equal context
    (cpu_decode_attention.cc, DecodeCall::run): every (sequence, head) is still computed once and right, padding rows
    included, wherever they fall."""
    rng = np.random.default_rng(11)
    kh, g, d, p, b = 3, 3, 64, 16, 32
    lens = rng.integers(1, b * p + 1, 40).astype(np.int32)
    lens[[5, 17, 36, 37, 38, 39]] = 0  # padding rows in the middle and at the end
    n_blocks = len(lens) * b
    tables = rng.permutation(n_blocks).reshape(len(lens), b).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), kh, g, d)), jnp.float32)
    k_pages = jnp.asarray(rng.standard_normal((n_blocks, kh, p, d)) * 2, dtype)
    v_pages = jnp.asarray(rng.standard_normal((n_blocks, kh, p, d)), dtype)
    fn = jax.jit(functools.partial(cpu_native.decode_attention, scale=d**-0.5, sliding_window=None))
    out = np.asarray(fn(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lens)))
    np.testing.assert_allclose(out, _route_one(q, k_pages, v_pages, tables, lens, d**-0.5, None), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(out[lens == 0], 0.0)
    for _ in range(3):  # the same answer every time: no part is lost or computed twice by racing threads
        np.testing.assert_array_equal(np.asarray(fn(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lens))), out)


@needs_kernel
def test_bf16_bits_cache():
    """A bf16 cache on the CPU is stored as uint16 bits (fp8.storage_dtype): the kernel reads it as bf16."""
    from jaxserve.pallas_kernels import fp8

    rng = np.random.default_rng(5)
    k_pages = jnp.asarray(rng.standard_normal((6, 2, 16, 64)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((6, 2, 16, 64)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 2, 3, 64)), jnp.float32)
    tables, lens = jnp.asarray([[4, 1], [0, 5]], jnp.int32), jnp.asarray([20, 9], jnp.int32)
    bits = [jax.lax.bitcast_convert_type(a, fp8.BF16_BITS) for a in (k_pages, v_pages)]
    assert cpu_native.reads(fp8.BF16_BITS)
    call = functools.partial(cpu_native.decode_attention, scale=0.125, sliding_window=None)
    np.testing.assert_array_equal(np.asarray(call(q, *bits, tables, lens)), np.asarray(call(q, k_pages, v_pages, tables, lens)))


@needs_kernel
def test_never_reads_past_the_context():
    """Slots past a sequence's length (stale or NaN in a real cache) must not reach its output."""
    rng = np.random.default_rng(0)
    k_pages = rng.standard_normal((8, 2, 16, 64)).astype(np.float32)
    v_pages = rng.standard_normal((8, 2, 16, 64)).astype(np.float32)
    k_pages[3, :, 5:] = np.nan
    v_pages[3, :, 5:] = np.nan
    tables = np.array([[1, 3, 0, 0]], np.int32)  # 21 tokens: block 1 whole, block 3's first 5
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 64)), jnp.float32)
    out = cpu_native.decode_attention(q, jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables),
                                      jnp.asarray([21], jnp.int32), scale=0.125, sliding_window=None)  # fmt: skip
    assert np.isfinite(np.asarray(out)).all()


@needs_kernel
def test_fp8_cache_keeps_the_jnp_route():
    """The kernel reads float32 and bfloat16 pages; over an fp8 cache ``native=True`` changes nothing."""
    from jaxserve.pallas_kernels.kv_layout import to_heads_major
    from jaxserve.pallas_kernels.random_batch import make_batch

    rng = np.random.default_rng(3)
    b = make_batch(rng, q_lens=[1, 1, 4], ctx_lens=[9, 30, 20], num_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=jnp.float32, pad_tokens=2, pad_seqs=1)  # fmt: skip
    fp8 = jnp.float8_e4m3fn
    args = (b.q, b.k_new, b.v_new, to_heads_major(b.k_pages).astype(fp8), to_heads_major(b.v_pages).astype(fp8), b.md)
    assert not cpu_native.reads(fp8) and cpu_native.reads(jnp.float32) and cpu_native.reads(jnp.bfloat16)
    plain = jax.jit(functools.partial(paged_attention_xla, scale=0.125))(*args)[0]
    native = jax.jit(functools.partial(paged_attention_xla, scale=0.125, native=True))(*args)[0]
    np.testing.assert_array_equal(np.asarray(native), np.asarray(plain))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "0")
    cpu_native.available.cache_clear()
    try:
        assert not cpu_native.available()
    finally:
        monkeypatch.undo()
        cpu_native.available.cache_clear()


def test_switch_names_kernels(monkeypatch):
    """A comma list keeps the kernels it names; a name that is no kernel says which names would work."""
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "attention")
    assert cpu_native.enabled("attention") and not cpu_native.enabled("gemv") and cpu_native.enabled()
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "gemv, attention")
    assert cpu_native.enabled("attention") and cpu_native.enabled("gemv")
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "1")
    assert cpu_native.enabled("gemv")
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "gemm")
    assert cpu_native.enabled("gemm") and not cpu_native.enabled("attention")
    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", "matmul")
    with pytest.raises(ValueError, match=r"'matmul'.*\['attention', 'gemm', 'gemv', 'qgemm'\]"):
        cpu_native.enabled("gemv")


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_native.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="jaxserve"):
            assert not cpu_native.available()
        assert "jnp path" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_native.available.cache_clear()


@needs_kernel
def test_backend_uses_the_kernel_only_without_tensor_parallelism():
    """XLA's partitioner cannot split a custom call: under TP the xla backend keeps its jnp route 1."""
    attention.get_attention_fn.cache_clear()
    one = attention._backend_fn("xla", "cpu", 1)
    assert isinstance(one, functools.partial) and one.keywords == {"native": True}
    assert attention._backend_fn("xla", "cpu", 2) is paged_attention_xla
    assert attention._backend_fn("xla", "gpu", 1) is paged_attention_xla

"""Token-minor V pages over an fp8 cache (kv_layout.py): the pallas backend's writes and kernels, interpreted
on CPU, against the reference over the usual layout and against the same backend with the switch off."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import fp8, kv_layout, kv_write
from jaxserve.pallas_kernels.attention import paged_attention as reference_backend
from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, paged_attention_pallas
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import write_kv

INTERPRET = jax.default_backend() == "cpu"


def _f32(x):
    return np.asarray(x, np.float32)


# The XLA scatter (kv_write="xla") is the fallback write for shapes the Pallas one does not take.
@pytest.mark.parametrize(
    "dtype,kv_write_impl", [(jnp.float8_e4m3fn, "pallas"), (jnp.float8_e5m2, "pallas"), (jnp.float8_e5m2, "xla")]
)
def test_pallas_backend_token_minor_v_agrees(dtype, kv_write_impl):
    """A mixed batch (decodes and a prefill chunk past one tile): the token-minor backend writes the same
    bytes (transposed), equals the token-major backend exactly and the reference within bf16's tolerance."""
    rng = np.random.default_rng(3)
    p, h, kh, d, k_scale, v_scale = 16, 8, 2, 64, 0.5, 2.0
    q_lens, cached = [1, 1, 21, 3, 1], [9, 70, 0, 17, 2]  # 21 > 16 tokens: the prefill kernel
    b = make_batch(
        rng, q_lens=q_lens, ctx_lens=[q + c for q, c in zip(q_lens, cached)], num_heads=h, num_kv_heads=kh,
        head_dim=d, block_size=p, dtype=jnp.float32, pad_tokens=2, pad_seqs=1,
    )  # fmt: skip
    q, k_new, v_new = (x.astype(jnp.bfloat16) for x in (b.q, b.k_new, b.v_new))
    k_pages, v_pages = fp8.quantize(b.k_pages, k_scale, dtype), fp8.quantize(b.v_pages, v_scale, dtype)
    with jax.default_matmul_precision("highest"):
        ref, k_ref, v_ref = reference_backend(
            q, k_new, v_new, k_pages, v_pages, b.md, scale=d**-0.5, k_scale=k_scale, v_scale=v_scale
        )
    cfg = GpuKernelConfig(kv_write=kv_write_impl, decode_tile_tokens=32)  # 32: several tiles, a whole-tile loop
    outs = {}
    for minor in (False, True):
        fn = jax.jit(functools.partial(
            paged_attention_pallas, scale=d**-0.5, interpret=INTERPRET, config=cfg, fp8_v_token_minor=minor
        ))  # fmt: skip
        v_in = kv_layout.to_token_minor(v_pages) if minor else v_pages
        outs[minor] = fn(q, k_new, v_new, k_pages, v_in, b.md, k_scale=k_scale, v_scale=v_scale)
    out, k_out, v_out = outs[True]
    assert v_out.shape == (v_pages.shape[0], kh, d, p) and v_out.dtype == dtype
    np.testing.assert_array_equal(_f32(k_out), _f32(k_ref))
    np.testing.assert_array_equal(_f32(kv_layout.to_token_major(v_out)), _f32(v_ref))
    n = int(b.md.query_start_loc[-1])
    np.testing.assert_array_equal(_f32(out)[:n], _f32(outs[False][0])[:n])
    out32, ref32 = _f32(out)[:n], _f32(ref)[:n]
    assert np.isfinite(out32).all()
    err = np.linalg.norm(out32 - ref32) / np.linalg.norm(ref32)
    assert err < 2e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("t", [1, 7])  # 1: the reference scatter's one-row path
def test_token_minor_write_round_trip(t):
    """Both writers (the Pallas kernel and the XLA scatter) put each new V row where the token-major write
    puts it, read back through the transposed view; padding slots (out of range) are dropped."""
    rng = np.random.default_rng(t)
    n, p, kh, d, dtype = 6, 16, 2, 32, jnp.float8_e4m3fn
    k_pages = jnp.asarray(rng.standard_normal((n, p, kh, d)), jnp.float32).astype(dtype)
    v_pages = jnp.asarray(rng.standard_normal((n, p, kh, d)), jnp.float32).astype(dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((t, kh, d)), jnp.float32) for _ in range(2))
    slots = rng.choice(n * p, t, replace=False)
    if t > 2:
        slots[-2:] = n * p  # the engine's padding tokens
    slots = jnp.asarray(slots, jnp.int32)
    want_k, want_v = write_kv(k_pages, v_pages, k_new, v_new, slots, 1.0, 0.5)
    v_minor = kv_layout.to_token_minor(v_pages)
    got_xla = write_kv(k_pages, v_minor, k_new, v_new, slots, 1.0, 0.5, v_token_minor=True)
    got_pallas = jax.jit(functools.partial(kv_write.write_kv_pallas, interpret=INTERPRET, v_scale=0.5, v_token_minor=True))(
        k_pages, v_minor, k_new, v_new, slots
    )
    for got_k, got_v in (got_xla, got_pallas):
        np.testing.assert_array_equal(_f32(got_k), _f32(want_k))
        np.testing.assert_array_equal(_f32(kv_layout.to_token_major(got_v)), _f32(want_v))
    # Read back: each written slot holds fp8(v / 0.5), found at [block, :, :, offset].
    real = np.asarray(slots) < n * p
    blk, off = np.asarray(slots)[real] // p, np.asarray(slots)[real] % p
    read = _f32(got_pallas[1])[blk, :, :, off]  # [T', K, D]
    np.testing.assert_array_equal(read, _f32(fp8.quantize(v_new, 0.5, dtype))[real])


def test_switch_applies_to_fp8_pallas_only(monkeypatch):
    monkeypatch.setattr(kv_layout, "FP8_V_TOKEN_MINOR", True)
    assert kv_layout.v_token_minor(jnp.float8_e4m3fn, "pallas", "gpu")
    assert kv_layout.v_token_minor(jnp.float8_e5m2, "pallas", "cpu")  # interpret mode, as in these tests
    assert not kv_layout.v_token_minor(jnp.bfloat16, "pallas", "gpu")
    assert not kv_layout.v_token_minor(jnp.float8_e4m3fn, "xla", "gpu")
    assert not kv_layout.v_token_minor(jnp.float8_e4m3fn, "pallas", "tpu")
    assert kv_layout.v_pages_shape(5, 16, 2, 64, True) == (5, 2, 64, 16)
    monkeypatch.setattr(kv_layout, "FP8_V_TOKEN_MINOR", False)
    assert not kv_layout.v_token_minor(jnp.float8_e4m3fn, "pallas", "gpu")


def test_engine_greedy_tokens_equal_with_switch_on(monkeypatch):
    """A tiny random Llama over an e4m3 cache, pallas backend interpreted: the switch changes the V pages'
    layout and nothing of the tokens (prefill chunks, decodes, the KV write between them, and a second
    request that reads the first one's blocks from the prefix cache)."""
    from engine_fixtures import checkpoint, small_engine_kwargs

    from jaxserve import LLM, SamplingParams

    path = checkpoint("llama_gqa")
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(2, 500, size=n).tolist()} for n in (5, 40)]  # 40 > 32: a chunked prefill
    params = SamplingParams(temperature=0.0, max_tokens=3)  # decodes after a prefill; each step is interpreted
    kw = small_engine_kwargs(
        max_num_batched_tokens=32, max_num_seqs=2, kv_cache_dtype="fp8_e4m3", attention_backend="pallas", precompile="none"
    )  # fmt: skip
    got = {}
    for minor in (False, True):
        monkeypatch.setattr(kv_layout, "FP8_V_TOKEN_MINOR", minor)
        llm = LLM(path, **kw)
        k_pages, v_pages = llm.llm_engine.runner.kv_caches[0]
        n, p, kh, d = k_pages.shape
        assert v_pages.shape == ((n, kh, d, p) if minor else (n, p, kh, d))
        got[minor] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = {"prompt_token_ids": prompts[1]["prompt_token_ids"][:36] + [7, 9]}  # 36 tokens = 9 cached blocks
        (out,) = llm.generate([again], params, use_tqdm=False)
        assert out.num_cached_tokens >= 32
        got[minor].append(out.outputs[0].token_ids)
    assert got[True] == got[False], got

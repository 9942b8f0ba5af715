"""One-row products by the CPU's native kernel (cpu_native.matvec / matvec_t, cpu_gemv.cc), float32 and bf16:
equal to the plain product, taken by a single-stream decode step on one device, and never traced under TP or
outside a step that allows it. Greedy tokens stay equal to HF transformers (float32) and to the plain bf16
program (bf16)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import VARIANTS, hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.models import cpu_bf16
from jaxserve.pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.loaded("gemv"), reason="no C++ compiler to build the kernel")


@pytest.mark.parametrize("k,n", [(576, 3072), (1536, 576), (64, 49152), (7, 5), (3, 1), (2048, 2048), (37, 100)])
def test_matvec_equals_the_product(k, n):
    """Shapes that split over threads (several slices, a remainder of rows), ones too small to split, and ones
    whose rows end part-way through a cache line (the vector loops' tails)."""
    rng = np.random.default_rng(k + n)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(jax.jit(cpu_native.matvec)(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    table = jnp.asarray(rng.standard_normal((n, k)), jnp.float32)
    got_t = np.asarray(jax.jit(cpu_native.matvec_t)(table, x))
    np.testing.assert_allclose(got_t, np.asarray(x, np.float64) @ np.asarray(table, np.float64).T, rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))  # fmt: skip


@pytest.mark.parametrize("k,n", [(576, 3072), (1536, 576), (7, 5), (37, 100), (130, 1000)])
def test_bf16_matvec_sums_in_float32(k, n):
    """bf16 operands, widened exactly and summed in float32: the float64 product of the same bf16 values."""
    rng = np.random.default_rng(k * n)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    got = jax.jit(cpu_native.matvec)(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), x64 @ w64, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    table = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    got_t = np.asarray(jax.jit(cpu_native.matvec_t)(table, x))
    np.testing.assert_allclose(got_t, x64 @ np.asarray(table, np.float64).T, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    with cpu_native.products(True):  # a bf16 projection: the kernel's float32 sums rounded once to bf16
        y = jax.jit(lambda a, b: cpu_bf16.matmul(a, b, None, jnp.bfloat16))(x, w)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(got.astype(jnp.bfloat16)))


@pytest.mark.parametrize("rows", [1, 5])  # the one-row kernel, and the few-row one (cpu_gemm.cc)
def test_native_products_keep_the_output_axes(rows, monkeypatch):
    monkeypatch.setattr(cpu_native, "_has_avx512", lambda: True)  # the few-row kernel is taken only with AVX-512
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((rows, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 2, 3, 8)), jnp.float32)  # a fused projection's [in, K, G+2, Dh]
    with cpu_native.products(True):
        fn = jax.jit(lambda a, b: cpu_bf16.matmul(a, b, None))
        got = fn(x, w)
    assert ("jaxserve_cpu_gemm" in fn.lower(x, w).as_text()) == (rows > 1)
    assert got.shape == (rows, 2, 3, 8)
    np.testing.assert_allclose(np.asarray(got), np.einsum("ti,ikgd->tkgd", x, w), rtol=1e-5, atol=1e-5)


def test_only_where_a_step_allows_it():
    """Outside ``products(True)``, and for more than one row, mixed dtypes or float16, the plain product is
    traced."""
    x1, x2 = jnp.ones((1, 8), jnp.float32), jnp.ones((2, 8), jnp.float32)
    w = jnp.ones((8, 4), jnp.float32)

    def traced(x, kernel, allowed):
        with cpu_native.products(allowed):
            return jax.jit(lambda a, b: cpu_bf16.matmul(a, b, None)).lower(x, kernel).as_text()

    assert "jaxserve_cpu_gemv" in traced(x1, w, True)
    assert "jaxserve_cpu_gemv" not in traced(x1, w, False)
    assert "jaxserve_cpu_gemv" not in traced(x2, w, True)
    assert "jaxserve_cpu_gemv_bf16" in traced(x1.astype(jnp.bfloat16), w.astype(jnp.bfloat16), True)
    assert "jaxserve_cpu_gemv" not in traced(x1.astype(jnp.float16), w.astype(jnp.float16), True)
    assert "jaxserve_cpu_gemv" not in traced(x1, w.astype(jnp.bfloat16), True)


def _count_calls(monkeypatch) -> dict:
    calls = {"matvec": 0, "matvec_t": 0, "gemm": 0}
    for name in calls:
        real = getattr(cpu_native, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(cpu_native, name, counted)
    return calls


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_single_stream_uses_the_kernel_and_matches_hf(variant, monkeypatch):
    """One request at a time: its decode steps are one-row steps, traced with the kernel; tokens equal HF's."""
    calls = _count_calls(monkeypatch)
    path = checkpoint(variant)
    llm = LLM(path, **small_engine_kwargs())
    assert llm.llm_engine.runner.native_products
    params = SamplingParams(temperature=0.0, max_tokens=10)
    for n in (1, 9, 40):
        prompt = np.random.default_rng(n).integers(2, 500, size=n).tolist()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == hf_greedy(path, prompt, 10), f"prompt of {n} tokens"
    assert calls["matvec"] > 0


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_mha_tied"])
def test_bf16_single_stream_takes_the_kernel(variant, monkeypatch):
    """A bf16 model's one-row steps read its bf16 weights in the kernel; the greedy tokens are those of the plain
    bf16 program (XLA's two-row form), which sums in float32 too."""
    path = checkpoint(variant)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [{"prompt_token_ids": np.random.default_rng(n).integers(2, 500, size=n).tolist()} for n in (3, 30)]

    def run():
        llm = LLM(path, **small_engine_kwargs(dtype="bfloat16"))
        return [o.outputs[0].token_ids for p in prompts for o in llm.generate([p], params, use_tqdm=False)]

    plain_use = cpu_native.use_matvec
    monkeypatch.setattr(cpu_native, "use_matvec", lambda *a: False)
    plain = run()
    monkeypatch.setattr(cpu_native, "use_matvec", plain_use)
    calls = _count_calls(monkeypatch)
    assert run() == plain
    assert calls["matvec"] > 0 and (calls["matvec_t"] > 0) == (variant == "llama_mha_tied")


def test_not_under_tensor_parallelism(monkeypatch):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 host devices")
    calls = _count_calls(monkeypatch)
    path = checkpoint("llama_gqa")
    llm = LLM(path, **small_engine_kwargs(tensor_parallel_size=2))
    assert not llm.llm_engine.runner.native_products
    prompt = list(range(2, 20))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 6)
    assert calls == {"matvec": 0, "matvec_t": 0, "gemm": 0}


def test_calls_at_once_from_two_threads():
    """The kernel's helper threads serve one call at a time; a second call meanwhile takes XLA's pool. Both stay
    exact."""
    import threading

    rng = np.random.default_rng(5)
    ws = [jnp.asarray(rng.standard_normal((576, 3072)), jnp.float32) for _ in range(2)]
    xs = [jnp.asarray(rng.standard_normal((1, 576)), jnp.float32) for _ in range(2)]
    f = jax.jit(cpu_native.matvec)
    wants = [np.asarray(f(x, w)) for x, w in zip(xs, ws)]
    errors = []

    def hammer(i):
        for _ in range(40):
            got = np.asarray(f(xs[i], ws[i]))
            if not np.array_equal(got, wants[i]):
                errors.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors

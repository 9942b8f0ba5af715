"""Products of a few rows by the CPU's native kernel (cpu_native.gemm, cpu_gemm.cc), float32: equal to the float64
product for every row count and panel tail, taken by decode steps of several sequences on one device (greedy tokens
still HF's), and never traced outside a step that allows it, for one row, past GEMM_MAX_ROWS, or in bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.models import cpu_bf16
from jaxserve.pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.loaded("gemm"), reason="no C++ compiler to build the kernel")


@pytest.fixture(autouse=True)
def _as_with_avx512(monkeypatch):
    # Steps take the kernel only on a CPU with AVX-512 (cpu_native.use_gemm); its plain loops elsewhere are correct
    # but slower than XLA's GEMM. The tests check it on every CPU.
    monkeypatch.setattr(cpu_native, "_has_avx512", lambda: True)


@pytest.mark.parametrize("m", [2, 5, 6, 7, 13, 48, 64])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (64, 40), (37, 100), (8, 3)])
def test_gemm_equals_the_product(m, k, n):
    """Row counts below, at and past one tile of six rows (read in place up to six, packed beyond), whole panels of
    64 columns and narrower last ones (40, 100 = 64 + 36, 3)."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    got = np.asarray(jax.jit(cpu_native.gemm)(x, w))
    np.testing.assert_allclose(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5,
                               atol=1e-5 * np.sqrt(k))  # fmt: skip


def test_only_where_a_step_allows_it():
    w = jnp.ones((8, 4), jnp.float32)

    def traced(rows, allowed, dtype=jnp.float32):
        with cpu_native.products(allowed):
            fn = jax.jit(lambda a, b: cpu_bf16.matmul(a, b, None))
            return fn.lower(jnp.ones((rows, 8), dtype), w.astype(dtype)).as_text()

    assert "jaxserve_cpu_gemm" in traced(2, True) and "jaxserve_cpu_gemm" in traced(cpu_native.GEMM_MAX_ROWS, True)
    assert "jaxserve_cpu_gemm" not in traced(2, False)
    assert "jaxserve_cpu_gemm" not in traced(1, True)  # one row: the one-row kernel
    assert "jaxserve_cpu_gemm" not in traced(cpu_native.GEMM_MAX_ROWS + 1, True)
    assert "jaxserve_cpu_gemm" not in traced(4, True, jnp.bfloat16)


def test_several_sequences_take_the_kernel_and_match_hf(monkeypatch):
    """Requests decoded together: their steps of several rows trace the kernel, and every request's greedy tokens
    are HF's (with chunked prefill, since the prompts outgrow the small token budget)."""
    calls = [0]
    real = cpu_native.gemm

    def counted(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(cpu_native, "gemm", counted)
    path = checkpoint("llama_gqa")
    llm = LLM(path, **small_engine_kwargs(max_num_batched_tokens=64))
    prompts = [np.random.default_rng(n).integers(2, 500, size=n).tolist() for n in (3, 17, 40, 70, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8), f"prompt of {len(prompt)} tokens"
    assert calls[0] > 0

"""bfloat16 on the CPU: the cache stored as bits and the products in XLA:CPU's fast forms give the same values
as the plain bf16 program did (which converted whole caches and weights to float32 in every step)."""

from __future__ import annotations

import contextlib
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.models import cpu_bf16
from jaxserve.pallas_kernels import fp8
from jaxserve.pallas_kernels.reference import write_kv

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's bf16 forms")


def test_bits_round_trip_is_the_bf16_cast():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 3, 8)) * 100, jnp.float32)
    stored = fp8.quantize(x, 1.0, fp8.BF16_BITS)
    assert stored.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(stored, 1.0)), np.asarray(x.astype(jnp.bfloat16), np.float32))
    assert fp8.dequantize(stored, 1.0, jnp.bfloat16).dtype == jnp.bfloat16


def test_storage_dtype_only_for_bf16_gather_backends_on_cpu():
    assert fp8.storage_dtype(jnp.bfloat16, "cpu", gather_backend=True) == jnp.uint16
    assert fp8.storage_dtype(jnp.bfloat16, "cpu", gather_backend=False) == jnp.bfloat16  # pallas in interpret mode
    assert fp8.storage_dtype(jnp.bfloat16, "gpu", gather_backend=True) == jnp.bfloat16
    assert fp8.storage_dtype(jnp.float32, "cpu", gather_backend=True) == jnp.float32
    assert fp8.storage_dtype(jnp.float8_e4m3fn, "cpu", gather_backend=True) == jnp.float8_e4m3fn


def _cache_sized_f32_arrays(pages_dtype) -> list[str]:
    shape = (64, 16, 3, 8)
    pages = jnp.zeros(shape, pages_dtype)
    new = jnp.ones((2, 3, 8), jnp.bfloat16)
    hlo = jax.jit(write_kv, donate_argnums=(0, 1)).lower(pages, pages, new, new, jnp.arange(2, dtype=jnp.int32))
    return [m for m in re.findall(r"f32\[([\d,]+)\]", hlo.compile().as_text()) if np.prod([int(d) for d in m.split(",")]) >= np.prod(shape)]


def test_a_bits_cache_write_converts_no_whole_cache():
    assert not _cache_sized_f32_arrays(fp8.BF16_BITS)


def test_xla_cpu_bf16_scatter_still_converts_the_whole_cache():
    """Why the bits exist: jax 0.10's XLA:CPU scatters bf16 through a float32 copy of the whole cache. jax 0.11.2's
    does not (seen on the device image); the bits cost nothing there, so only the premise's test is skipped."""
    if not _cache_sized_f32_arrays(jnp.bfloat16):
        pytest.skip(f"jax {jax.__version__}: XLA:CPU scatters bf16 in place; the bits are kept, harmless")


@pytest.mark.parametrize("rows", [1, 3])
def test_fast_forms_compute_the_plain_products(rows):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((48, 4, 5)) * 0.1, jnp.bfloat16)
    table = jnp.asarray(rng.standard_normal((96, 48)) * 0.1, jnp.bfloat16)
    x32, k32, t32 = (np.asarray(a, np.float32) for a in (x, kernel, table))
    got = cpu_bf16.matmul(x, kernel, None)
    assert got.shape == (rows, 4, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.einsum("mi,ijk->mjk", x32, k32), rtol=1e-5, atol=1e-5)
    logits = cpu_bf16.tied_logits(x, table, None)
    assert logits.shape == (rows, 96)
    np.testing.assert_allclose(np.asarray(logits), x32 @ t32.T, rtol=1e-5, atol=1e-5)


# Prefix caching, chunked prefill (a 16-token budget) and preemption (24 blocks for sequences of up to 16 each).
FEATURES = dict(dtype="bfloat16", max_model_len=64, enable_prefix_caching=True, max_num_batched_tokens=16,
                num_gpu_blocks_override=24, precompile="none")  # fmt: skip


@functools.lru_cache(maxsize=None)
def _run(bits: bool) -> tuple:
    from jaxserve import model_runner

    # The plain engine: caches allocated in bf16 itself, as before bits.
    plain = mock.patch.object(model_runner, "storage_dtype", lambda dtype, platform, gather: jnp.dtype(dtype))
    with contextlib.nullcontext() if bits else plain:
        llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(**FEATURES))
    rng = np.random.default_rng(3)
    prefix = rng.integers(2, 500, size=24).tolist()
    prompts = [{"prompt_token_ids": prefix + rng.integers(2, 500, size=n).tolist()} for n in (6, 17, 2, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    runner = llm.llm_engine.runner
    return (tuple(tuple(o.outputs[0].token_ids) for o in outs), runner.kv_caches[0][0].dtype, runner.kv_dtype,
            llm.llm_engine.get_stats())  # fmt: skip


def test_bits_cache_gives_the_plain_bf16_tokens():
    tokens, stored, kv_dtype, stats = _run(bits=True)
    plain_tokens, plain_stored, _, _ = _run(bits=False)
    assert (stored, kv_dtype, plain_stored) == (jnp.uint16, jnp.bfloat16, jnp.bfloat16)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert tokens == plain_tokens


@pytest.mark.parametrize("rows", [1, 3])
def test_folded_lora_projection_in_the_fast_form(rows):
    """A bf16 LoRA projection with its A folded beside the base kernel (one product) gives the unfolded one's
    output (base product, then shrink and expand apart), both in XLA:CPU's fast forms."""
    from flax import nnx

    from jaxserve.models.layers import Linear
    from jaxserve.models.lora import LoRABatch, fold

    rng = np.random.default_rng(rows)
    linear = Linear(48, (4, 5), axes=("embed", None, None), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                    rngs=nnx.Rngs(0))  # fmt: skip
    a = jnp.asarray(rng.standard_normal((48, 2, 1, 4)) * 0.1, jnp.bfloat16)  # [in, N, P, r]
    b = jnp.asarray(rng.standard_normal((2, 1, 4, 4, 5)) * 0.1, jnp.bfloat16)  # [N, P, r, *out]
    x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.bfloat16)
    mask = jnp.asarray(np.eye(2, dtype=np.float32)[np.arange(rows) % 2])  # tokens alternate between the slots
    folded = LoRABatch({"g": (fold(linear.kernel[...], a), b)}, mask).project("g", x, linear)
    apart = LoRABatch({"g": (a, b)}, mask).project("g", x, linear)
    assert folded.shape == apart.shape == (rows, 4, 5) and folded.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(folded, np.float32), np.asarray(apart, np.float32), rtol=2e-2, atol=2e-2)

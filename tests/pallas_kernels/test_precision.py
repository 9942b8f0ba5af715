"""The attention backends' matmul precision: float32 exact by default, what the caller asks otherwise.

Checked on the lowered StableHLO, where each dot carries its precision. For the Pallas backend that is the
interpret-mode program, whose dots are the kernels' own ``plgpu.dot`` calls with the precision the Triton
lowering would get (HIGHEST: IEEE float32; HIGH or DEFAULT: TF32). The Mosaic GPU prefill takes only
bf16/fp16, so a float32 prefill must go to the Triton kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_precision import dot_precisions, jnp_attention

from jaxserve import config
from jaxserve.pallas_kernels import mosaic_prefill, precision
from jaxserve.pallas_kernels import kv_layout
from jaxserve.pallas_kernels.attention import get_attention_fn
from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, _use_mosaic_prefill
from jaxserve.pallas_kernels.random_batch import make_batch

HIGH, HIGHEST = jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST


def test_matmul_precision_from_dtype_and_option():
    assert precision.matmul_precision(jnp.float32) == HIGHEST
    assert precision.matmul_precision(jnp.float32, "tf32") == HIGH
    for dtype in (jnp.bfloat16, jnp.float16):
        for option in precision.FP32_MATMUL_PRECISIONS:
            assert precision.matmul_precision(dtype, option) is None  # JAX's default: programs unchanged
    want = r"fp32_matmul_precision='high' is invalid: choose one of \('highest', 'tf32'\)"
    with pytest.raises(ValueError, match=want):
        precision.matmul_precision(jnp.float32, "high")


def test_config_mirrors_the_kernel_options():
    # jaxserve.config keeps its own copy so that parsing flags imports no JAX.
    assert config.FP32_MATMUL_PRECISIONS == precision.FP32_MATMUL_PRECISIONS


# (dtype, precision passed) -> precision every dot of the backend must carry.
CASES = [
    (jnp.float32, None, "HIGHEST"),
    (jnp.float32, HIGH, "HIGH"),
    (jnp.float32, HIGHEST, "HIGHEST"),
    (jnp.bfloat16, None, "DEFAULT"),
]


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])
@pytest.mark.parametrize("dtype,prec,want", CASES)
def test_backend_dots_carry_the_precision(backend, dtype, prec, want):
    # A decode and a prefill chunk with cached context: every route of every backend (Pallas: both kernels).
    b = make_batch(
        np.random.default_rng(0), q_lens=[1, 7], ctx_lens=[9, 12], num_heads=4, num_kv_heads=2, head_dim=16,
        block_size=4, dtype=dtype,
    )  # fmt: skip
    with jnp_attention():  # the jnp routes (the CPU's C++ kernel has no dots)
        fn = get_attention_fn(backend, "cpu")
    pages = (b.k_pages, b.v_pages)
    if kv_layout.heads_major(backend):  # the backend's own cache layout
        pages = tuple(map(kv_layout.to_heads_major, pages))
    text = (
        jax.jit(lambda *a: fn(*a, scale=0.25, precision=prec))
        .lower(b.q, b.k_new, b.v_new, *pages, b.md)
        .as_text()
    )
    counts = dot_precisions(text)
    assert set(counts) == {want} and counts[want] >= 2, counts


def test_float32_prefill_never_takes_the_mosaic_kernel():
    reason = mosaic_prefill.unsupported_reason(
        head_dim=128, dtype=jnp.float32, page_size=16, block_kv=128, sliding_window=None, interpret=False
    )
    assert reason is not None and "float32" in reason
    q = jnp.zeros((8, 4, 128), jnp.float32)
    assert not _use_mosaic_prefill(GpuKernelConfig(), q, 16, None, interpret=False)  # "auto": Triton
    with pytest.raises(ValueError, match="prefill_impl='mosaic' cannot run here: dtype float32"):
        _use_mosaic_prefill(GpuKernelConfig(prefill_impl="mosaic"), q, 16, None, interpret=False)


def test_float32_fma_products_take_small_tiles():
    from jaxserve.bench.kernel_sass import parse_overrides
    from jaxserve.pallas_kernels.paged_attention_pallas import FP32_FMA_TILES, kernel_config_for

    base = GpuKernelConfig()
    fma = kernel_config_for(base, jnp.float32, None)  # None resolves to HIGHEST for float32
    assert {k: getattr(fma, k) for k in FP32_FMA_TILES} == FP32_FMA_TILES
    assert fma.prefill_rows < base.prefill_rows and fma.decode_tile_tokens < base.decode_tile_tokens
    # TF32 and bf16 products run on the tensor cores, where the larger tiles fit; the option turns it off.
    assert kernel_config_for(base, jnp.float32, HIGH) == base
    assert kernel_config_for(base, jnp.bfloat16, None) == base
    assert kernel_config_for(GpuKernelConfig(fp32_fma_tiles=False), jnp.float32, HIGHEST).prefill_rows == base.prefill_rows
    chosen = kernel_config_for(GpuKernelConfig(decode_tile_tokens=16), jnp.float32, HIGHEST)  # the caller's tile stays
    assert chosen.decode_tile_tokens == 16 and chosen.decode_warps == FP32_FMA_TILES["decode_warps"]
    assert parse_overrides("decode_warps=4,fp32_fma_tiles=false") == {"decode_warps": 4, "fp32_fma_tiles": False}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides("warps=4")


def test_the_static_build_tool_lowers_the_step_kernels_for_cuda_here():
    """`bench kernel_sass` lowers the Triton kernels without a GPU (building them needs the triton package)."""
    from jaxserve.bench.kernel_sass import step_kernels

    mods, cfg = step_kernels("float32", "highest", {})
    assert len(mods) == 2 and all("tt.func public @jaxserve_paged_" in m for m in mods)
    assert cfg.prefill_rows == 64  # the float32-FMA tiles
    mods, cfg = step_kernels("bfloat16", "highest", {}, kv_cache_dtype="fp8_e4m3", v_token_minor=True)
    assert len(mods) == 2 and cfg.prefill_rows == GpuKernelConfig().prefill_rows


def test_the_decode_sass_tool_lowers_the_decode_kernel_with_overrides():
    """`bench decode_sass --set ...`: the Triton decode kernel alone, lowered here with the asked-for config."""
    from jaxserve.bench.decode_sass import lower_decode_ttir

    ttir = lower_decode_ttir("fp8_e4m3", True, 128, {"decode_warps": 4})
    assert "tt.func public @jaxserve_paged_decode" in ttir

"""fp8 (e4m3) weights with one scale per output: ``quantization="fp8"``, as vLLM quantizes a float checkpoint online.

After a model loads, ``quantize_model`` swaps the weight of every Linear (a decoder's projections and an untied
head) and every embedding table (a tied one is the head) for e4m3 codes and a float32 scale per output (the absolute maximum
over the output's inputs maps to 448, e4m3's largest value). Half the bytes of bf16: a decode step reads every
weight once, so its products read half as much. The codes are stored output-major (a Linear's [in, *out] kernel
as [*out, in]; an embedding table is [V, D] already), which is how the GEMV kernel reads them
(pallas_kernels/fp8_gemv.py): each output's inputs contiguous, the tensor cores' left operand.

Each product is ``(x @ codes.T) * scale`` with float32 sums, rounded once to the output dtype:
- "xla" (the default): XLA's product of the codes converted to the activations' dtype. On the GPU XLA fuses the
  conversion into its Triton GEMM, which read the 8B's decode products 1.5-1.65x faster than their bf16 form on an
  H100 (BENCHMARKS §48);
- "pallas" (opt-in, $JAXSERVE_FP8_WEIGHTS_MODE=pallas; one GPU only): the Pallas GEMV kernel for products of at
  most ``KERNEL_MAX_ROWS`` rows, XLA's for larger ones. In its default configuration it beat XLA only on the 1B's two
  smallest products (§48); it stays for tuning and comparison;
- "interpret": the kernel in Pallas's interpreter (tests on the CPU).

Speculative decoding stays exact with an fp8 draft (rejection sampling needs only the distribution the draft
proposed from); a target in fp8 is a different model from its checkpoint, as any quantization is.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
KERNEL_MAX_ROWS = 64  # products of at most this many rows run the GEMV kernel ("pallas"); larger ones XLA's
MODES = ("pallas", "xla", "interpret")


def default_mode(platform: str, num_devices: int) -> str:
    """XLA's product, unless $JAXSERVE_FP8_WEIGHTS_MODE names another of MODES: benchmarks compare the kernel with
    it, tests interpret the kernel. The kernel needs one GPU: it does not take a TP mesh's sharded weights."""
    forced = os.environ.get("JAXSERVE_FP8_WEIGHTS_MODE")
    if not forced:
        return "xla"
    if forced not in MODES:
        raise ValueError(f"JAXSERVE_FP8_WEIGHTS_MODE={forced!r}: choose one of {MODES}, or unset it")
    if forced == "pallas" and (platform != "gpu" or num_devices > 1):
        raise ValueError(f"JAXSERVE_FP8_WEIGHTS_MODE=pallas runs a GPU kernel on one device, but this engine runs on "
                         f"{num_devices} {platform} device(s): unset it (XLA's product), or use 'interpret' (tests)")
    return forced


def is_fp8(module) -> bool:
    return bool(getattr(module, "fp8_mode", None))


@jax.jit
def _quantize_columns(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [in, *out] -> (codes [*out, in] e4m3, scale [*out] float32): one scale per output, over its inputs."""
    w32 = w.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w32), axis=0), 1e-12) / FP8_MAX  # [*out]
    codes = (w32 / scale).astype(FP8)  # [in, *out]
    return jnp.moveaxis(codes, 0, -1), scale


@jax.jit
def _quantize_rows(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """table [V, D] -> (codes [V, D] e4m3, scale [V] float32): one scale per row (the tied head's output)."""
    t32 = table.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(t32), axis=1), 1e-12) / FP8_MAX  # [V]
    return (t32 / scale[:, None]).astype(FP8), scale


def quantize_model(model: nnx.Module, mode: str) -> nnx.Module:
    """Swap every Linear's kernel and every Embed's table of ``model`` (loaded, concrete) for e4m3 codes and scales,
    in place; ``mode`` is how their products run (MODES). The sharding names move with the axes."""
    from jaxserve.models.layers import Embed, Linear

    if mode not in MODES:
        raise ValueError(f"fp8 weights: mode={mode!r}; choose one of {MODES}")
    for _, module in list(nnx.iter_graph(model)):
        if isinstance(module, (Linear, Embed)) and (module.weight_block or is_fp8(module)):
            raise ValueError("fp8 weights: this model's weights are already quantized (a GGUF file kept quantized); "
                             "choose one quantization")
        if isinstance(module, Linear):
            param = module.kernel
            axes = param.get_metadata().get("out_sharding")
            codes, scale = _quantize_columns(param.get_value())
            new_axes = None if axes is None else (*axes[1:], axes[0])
            module.kernel = nnx.Param(codes, out_sharding=new_axes, eager_sharding=False)
            module.kernel_scale = nnx.Param(scale, out_sharding=None if axes is None else axes[1:], eager_sharding=False)
            module.fp8_mode = mode
        elif isinstance(module, Embed):
            param = module.embedding
            axes = param.get_metadata().get("out_sharding")
            codes, scale = _quantize_rows(param.get_value())
            module.embedding = nnx.Param(codes, out_sharding=axes, eager_sharding=False)
            module.embedding_scale = nnx.Param(scale, out_sharding=None if axes is None else axes[:1],
                                               eager_sharding=False)  # fmt: skip
            module.fp8_mode = mode
    return model


def product(x: jax.Array, codes: jax.Array, scale: jax.Array, out_dtype, mode: str, precision=None) -> jax.Array:
    """x [T, K] @ (codes [*out, K] * scale [*out]).T -> [T, *out] in ``out_dtype`` (float32 sums, rounded once)."""
    out_shape = codes.shape[:-1]
    n, k = math.prod(out_shape), codes.shape[-1]
    w, s = codes.reshape(n, k), scale.reshape(n)
    y = _matmul(x, w, s, out_dtype, mode, precision)
    return y.reshape(x.shape[0], *out_shape)


def lookup(ids: jax.Array, codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Rows ``ids`` of an fp8 table [V, D] with its row scales [V] -> [T, D] in ``dtype``."""
    rows = jnp.take(codes, ids, axis=0).astype(jnp.float32) * jnp.take(scale, ids, axis=0)[:, None]
    return rows.astype(dtype)


def _matmul(x: jax.Array, w: jax.Array, s: jax.Array, out_dtype, mode: str, precision) -> jax.Array:
    # x [T, K], w [N, K] e4m3, s [N] -> [T, N]
    if mode in ("pallas", "interpret") and x.shape[0] <= KERNEL_MAX_ROWS:
        from jaxserve.pallas_kernels import fp8_gemv

        if fp8_gemv.fits(w.shape[1], w.shape[0], fp8_gemv.pick_config(w.shape[1], w.shape[0], x.shape[0])):
            return fp8_gemv.fp8_gemv_nk(x, w, s, out_dtype, interpret=mode == "interpret")
    y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)  # fmt: skip
    return (y * s).astype(out_dtype)

"""The KV cache's stored form: how values are stored (quantize) and read back (dequantize).

Mostly about fp8 caches (below). One other stored form: a bfloat16 cache that a gather backend (``xla``,
``reference``) keeps on XLA:CPU is stored as its raw bits, in uint16 (``storage_dtype``). XLA:CPU has no bf16
scatter: it converted every layer's whole cache to float32 and back to write one step's keys (11.7 ms for one
layer's K of the default model, against 29 µs for the same scatter on uint16; docs/BENCHMARKS.md §30). Stored
as bits, the write scatters integers and a reader converts only the rows it gathered. The values are exactly
the bf16 ones; sizes, budgets and everything outside the attention backends still see ``kv_dtype`` bf16.

A cache in an fp8 dtype holds ``clip(x / scale, -max, max)`` rounded to that dtype; a reader multiplies by
``scale`` again. Clipping first matters: a plain cast of a value past the format's range gives NaN
(float8_e4m3fn has no inf) or inf (float8_e5m2), and one NaN key poisons every later softmax of its
sequence. ``scale`` is per layer, for K and V separately (1.0 by default, as in vLLM); inside the jitted
attention it is a traced float32 scalar, so layers with different scales share one trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# kv_cache_dtype (EngineArgs) -> the cache's dtype; "auto" is the model's dtype (see kv_cache_dtype_for).
FP8_DTYPES = {
    "fp8": jnp.float8_e4m3fn,  # vLLM's meaning of plain "fp8"
    "fp8_e4m3": jnp.float8_e4m3fn,  # 3 mantissa bits, range +-448: the more accurate
    "fp8_e5m2": jnp.float8_e5m2,  # 2 mantissa bits, range +-57344: the wider
}


def kv_cache_dtype_for(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    """The cache's dtype for an (already validated) ``kv_cache_dtype``; dashes work as underscores."""
    name = kv_cache_dtype.replace("-", "_")
    return jnp.dtype(model_dtype) if name == "auto" else jnp.dtype(FP8_DTYPES[name])


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


BF16_BITS = jnp.dtype(jnp.uint16)  # a bf16 cache stored as its bits (see the module's docstring)


def storage_dtype(kv_dtype, platform: str, gather_backend: bool) -> jnp.dtype:
    """The dtype the cache arrays are allocated in: ``kv_dtype``, except bf16 bits for a gather backend on CPU."""
    kv_dtype = jnp.dtype(kv_dtype)
    return BF16_BITS if kv_dtype == jnp.bfloat16 and platform == "cpu" and gather_backend else kv_dtype


def quantize(x: jax.Array, scale, dtype) -> jax.Array:
    """Values as the cache stores them: divided by ``scale``, clipped to ``dtype``'s range, rounded.
    For a non-fp8 ``dtype`` a plain cast (scales apply to fp8 caches only); bf16 bits for ``BF16_BITS``."""
    if jnp.dtype(dtype) == BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BF16_BITS)
    if not is_fp8(dtype):
        return x.astype(dtype)
    big = float(jnp.finfo(dtype).max)
    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    return jnp.clip(y, -big, big).astype(dtype)


def dequantize(x: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    """What a reader sees of stored values, in ``dtype``: times ``scale`` for an fp8 cache, else a cast."""
    if x.dtype == BF16_BITS:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    if not is_fp8(x.dtype):
        return x.astype(dtype)
    return (x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


def fold_scale(x: jax.Array, scale) -> jax.Array:
    """``x`` times a K or V scale, rounded back to ``x``'s dtype. Kernels that read fp8 pages as stored fold the
    scales outside themselves (dequantization is linear): q·(k·ks) = (q·ks)·k, and sum p·(v·vs) = vs·sum p·v.
    One extra rounding in ``x``'s dtype, exact for the default scale 1.0."""
    return (x.astype(jnp.float32) * scale).astype(x.dtype)


def round_trip(x: jax.Array, scale, dtype) -> jax.Array:
    """``x`` as a reader of an fp8 cache sees it after a write (float32): quantize, then dequantize.

    The barrier keeps the rounding: with excess precision allowed (its default) XLA:GPU folds a
    float32 -> fp8 -> float32 convert pair away, and the rounded keys were then the unrounded ones
    (2.5% off the reference on the H200, 2026-12-01)."""
    return dequantize(jax.lax.optimization_barrier(quantize(x, scale, dtype)), scale)


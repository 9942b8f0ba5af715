"""Products of a few rows with float8 (e4m3) weights on the GPU (Pallas, Triton lowering): W8A16 decode products.

A decode step's products are memory-bound: each weight byte is read once for a handful of rows, so fp8 weights
halve the bytes. This kernel was written to stream them at the copy rate, against XLA's own product of
``x @ convert(w)`` (a Triton GEMM fusion with the conversion inside). Timed on an H100 (BENCHMARKS §48), XLA's product
won on most shapes, so models/fp8_weights.py runs it by default and this kernel is opt-in. Every program owns a
``[K / splits, BN]`` panel of ``w [K, N]`` (N contiguous, so each row of a tile is one coalesced read), converts
each ``[BK, BN]`` tile to the activations' dtype in registers and multiplies it on the tensor cores with all M rows
at once (M padded to 16, the smallest tile they take). With ``splits`` > 1 the K range is cut in parts, each
program writes float32 partial sums, and one XLA fusion adds the parts, applies
the per-column scale and rounds: enough programs for every SM even where N / BN is small.

``transposed=True`` takes the weight as ``[N, K]`` (K contiguous), which is how a tied embedding table is the
output head: a program then owns BN rows of the table, each read whole along K.

The weight's per-output-column scale is applied after the sums (``y = (x @ q) * s``), which is the same function
as multiplying by the dequantized weight up to float32 rounding of the sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16  # the tensor cores' smallest row tile: fewer rows are padded to it


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 128  # output columns per program
    block_k: int = 256  # input rows of the weight per loop step
    splits: int = 1  # parts the K range is cut into (programs per column block)
    num_warps: int = 4
    num_stages: int = 3


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, steps: int, transposed: bool, precision):
    # x_ref [M, K / splits] (this program's part); w_ref [K / splits, BN] ([BN, K / splits] transposed);
    # o_ref [1, M, BN] float32
    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        if transposed:
            w = w_ref[:, pl.ds(k0, block_k)].astype(x.dtype)  # [BN, BK]
            dims = (((1,), (1,)), ((), ()))
        else:
            w = w_ref[pl.ds(k0, block_k), :].astype(x.dtype)  # [BK, BN]
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)

    block_n = w_ref.shape[0] if transposed else w_ref.shape[1]
    acc = lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[0] = acc


def pick_config(k: int, n: int, rows: int) -> GemvConfig:
    """A configuration that keeps every SM of an H100/H200 busy: column blocks x splits >= ~2 programs per SM."""
    del rows
    block_n = 128
    splits = 1
    while (n // block_n) * splits < 264 and k // (splits * 2) >= 256 and splits < 8:
        splits *= 2
    return GemvConfig(block_n=block_n, block_k=256 if k // splits >= 256 else 128, splits=splits)


def fits(k: int, n: int, config: GemvConfig) -> bool:
    """Whether ``config`` tiles a ``[k, n]`` weight exactly (the kernel has no edge masks)."""
    return n % config.block_n == 0 and k % (config.splits * config.block_k) == 0


def _setup(x: jax.Array, n: int, config: GemvConfig | None):
    """(config, the rows padded to the tensor cores' tile, K per split, the dot's precision) for ``x [M, K]`` and
    ``n`` outputs; a ValueError when the configuration does not tile the weight."""
    m, k = x.shape
    config = config or pick_config(k, n, m)
    if not fits(k, n, config):
        raise ValueError(f"fp8_gemv: a weight of {k} inputs and {n} outputs does not tile by {config}")
    rows = max(MIN_ROWS, -(-m // MIN_ROWS) * MIN_ROWS)
    xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return config, xp, k // config.splits, precision


def fp8_gemv(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype, *, transposed: bool = False,
             config: GemvConfig | None = None, interpret: bool = False) -> jax.Array:  # fmt: skip
    """``x [M, K] @ (w [K, N] float8 * scale [N])`` -> [M, N] in ``out_dtype``; float32 sums, rounded once.
    ``transposed``: ``w`` is [N, K] and the product is ``x @ (w * scale[:, None]).T``."""
    m = x.shape[0]
    n = w.shape[0] if transposed else w.shape[1]
    config, xp, part, precision = _setup(x, n, config)
    rows = xp.shape[0]
    if transposed:
        w_spec = pl.BlockSpec((config.block_n, part), lambda j, s: (j, s))
    else:
        w_spec = pl.BlockSpec((part, config.block_n), lambda j, s: (s, j))
    kernel = functools.partial(
        _kernel, block_k=config.block_k, steps=part // config.block_k, transposed=transposed, precision=precision
    )
    partial = pl.pallas_call(
        kernel,
        grid=(n // config.block_n, config.splits),
        in_specs=[pl.BlockSpec((rows, part), lambda j, s: (0, s)), w_spec],
        out_specs=pl.BlockSpec((1, rows, config.block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((config.splits, rows, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(xp, w)
    return (partial.sum(axis=0)[:m] * scale.astype(jnp.float32)).astype(out_dtype)


# ------------------------------------------------------------------ the weight as the product's left operand


def _kernel_nk(x_ref, w_ref, s_ref, o_ref, *, block_k: int, steps: int, precision, fused: bool):
    # x_ref [M, K / splits]; w_ref [BN, K / splits] (K contiguous); s_ref [BN]; o_ref [M, BN] out dtype when
    # ``fused`` (one split: the scale applied here), else [1, M, BN] float32 partial sums
    def body(i, acc):
        k0 = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]  # [M, BK]
        w = w_ref[:, pl.ds(k0, block_k)].astype(x.dtype)  # [BN, BK]: converted in registers, the MMA's A operand
        dims = (((1,), (1,)), ((), ()))
        return acc + lax.dot_general(w, x, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((w_ref.shape[0], x_ref.shape[0]), jnp.float32))  # [BN, M]
    if fused:
        o_ref[...] = (acc * s_ref[...][:, None]).T.astype(o_ref.dtype)
    else:
        o_ref[0] = acc.T


def fp8_gemv_nk(x: jax.Array, w: jax.Array, scale: jax.Array, out_dtype, *, config: GemvConfig | None = None,
                interpret: bool = False) -> jax.Array:  # fmt: skip
    """``x [M, K] @ (w [N, K] float8 * scale[:, None]).T`` -> [M, N] in ``out_dtype``: the weight stored output-major
    (each output's K values contiguous), so it is the tensor cores' left operand ([BN, BK] tiles, BN >= 64) and the
    rows the right one (M padded to 16)."""
    m, n = x.shape[0], w.shape[0]
    config, xp, part, precision = _setup(x, n, config)
    rows = xp.shape[0]
    fused = config.splits == 1
    kernel = functools.partial(
        _kernel_nk, block_k=config.block_k, steps=part // config.block_k, precision=precision, fused=fused
    )
    if fused:
        out_spec = pl.BlockSpec((rows, config.block_n), lambda j, s: (0, j))
        out_shape = jax.ShapeDtypeStruct((rows, n), out_dtype)
    else:
        out_spec = pl.BlockSpec((1, rows, config.block_n), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((config.splits, rows, n), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(n // config.block_n, config.splits),
        in_specs=[
            pl.BlockSpec((rows, part), lambda j, s: (0, s)),
            pl.BlockSpec((config.block_n, part), lambda j, s: (j, s)),
            pl.BlockSpec((config.block_n,), lambda j, s: (j,)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="fp8_gemv_nk",
    )(xp, w, scale.astype(jnp.float32))
    if fused:
        return out[:m]
    return (out.sum(axis=0)[:m] * scale.astype(jnp.float32)).astype(out_dtype)

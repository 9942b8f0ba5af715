"""A residual add fused with the RMSNorm after it (Pallas, Triton lowering): one kernel where XLA:GPU runs two.

A decoder layer adds each sublayer's output into the residual stream, then normalises the sum for the next
sublayer. XLA:GPU launches the add as one kernel and the norm as another (a Triton normalization fusion, which
takes no second output). For a decode step's few rows each is a ~2 µs launch: in the H200 trace of a Llama-3-8B
single stream, 63 standalone adds a step cost 0.12 ms of its 4.72 (docs/BENCHMARKS.md, session 13). This kernel
reads the two addends once and writes the new residual and its norm.

Numerics are ``models.layers.RMSNorm`` applied to the sum, step for step: the sum is rounded to the activation
dtype (HF adds the residual in the model's dtype), normalised in float32, cast back, then scaled by the weight
in the activation dtype. Only the order of the float32 sum of squares may differ from XLA's.

One program per row: the row is loaded whole into registers (padded to a power of two with masked lanes, as
Triton tiles need), so any hidden size runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, y_ref, w_ref, sum_ref, norm_ref, *, eps: float, width: int):
    d = x_ref.shape[-1]
    cols = jnp.arange(width, dtype=jnp.int32)
    ok = cols < d
    x = plgpu.load(x_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    y = plgpu.load(y_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    s = (x + y).astype(sum_ref.dtype)  # the residual, rounded as the unfused add rounds it
    plgpu.store(sum_ref.at[cols], s, mask=ok)
    s32 = s.astype(jnp.float32)
    var = jnp.sum(s32 * s32) / d  # masked lanes are zeros
    normed = (s32 * lax.rsqrt(var + eps)).astype(norm_ref.dtype)
    w = plgpu.load(w_ref.at[cols], mask=ok, other=0).astype(norm_ref.dtype)
    plgpu.store(norm_ref.at[cols], w * normed, mask=ok)


def add_rms_norm_pallas(
    x: jax.Array,  # [T, D]: the residual stream
    y: jax.Array,  # [T, D]: a sublayer's output, same dtype
    weight: jax.Array,  # [D]: the norm's scale (any float dtype; cast to x's, as RMSNorm does)
    *,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (x + y, rms_norm(x + y)), both [T, D] in x's dtype
    if x.shape != y.shape or x.ndim != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: x {x.shape}, y {y.shape} and weight {weight.shape} must be [T, D], [T, D], [D]")
    t, d = x.shape
    width = pl.next_power_of_2(d)
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, width=width),
        grid=(t,),
        in_specs=[row, row, pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((t, d), x.dtype)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(width // 512, 1), 8), num_stages=1),
        interpret=interpret,
        name="jaxserve_add_rms_norm",
    )(x, y.astype(x.dtype), weight)

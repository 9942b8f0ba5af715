"""bfloat16 products in the forms XLA:CPU sends to its fast kernels.

On a CPU with AVX512-BF16/AMX, XLA:CPU (jax 0.10) hands a bf16 x bf16 product to its library kernels only when
the product accumulates into float32 *and* has two or more rows; any other bf16 product it computes by
converting the whole weight to float32 first, in every step. The model's plain bf16 matmuls hit that path
everywhere: ``--dtype bfloat16`` on the CPU ran a single stream at 1.1 tok/s against fp32's 31 (2-core Xeon,
docs/BENCHMARKS.md §30). In the fast form, a [64, 576] x [576, 3072] product took 0.35 ms against 1.6 ms in
float32.

The forms here give the same numbers as the plain product: float32 accumulation rounded once to the output
dtype, which is also what the slow path computed. ``matmul`` is every projection's product: for other platforms
and dtypes (``applies`` is False) it is the plain one, so GPU and TPU programs are unchanged. One row (float32 or
bf16), in a step program that allows it, goes to the native one-row kernel instead (``cpu_native.matvec``): it
reads a bf16 weight as bf16, with float32 sums, where the padded two-row form above converts nothing but still
runs XLA:CPU's two-row GEMM. Float32 products of 2 to 64 rows go to the native few-row kernel
(``cpu_native.gemm``), faster there than XLA:CPU's GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import cpu_native


def applies(dtype) -> bool:
    """True for bfloat16 products compiled for XLA:CPU (the default backend: where the engine runs)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and jax.default_backend() == "cpu"


def _two_rows(x: jax.Array) -> jax.Array:
    # A lone row gets a zero partner, which the caller slices off: one-row bf16 products take the slow path.
    return jnp.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1)) if x.shape[0] == 1 else x


def matmul(x: jax.Array, kernel: jax.Array, precision, out_dtype=jnp.float32) -> jax.Array:
    """x [M, in] @ kernel [in, *out] -> [M, *out] in ``out_dtype``; x and kernel in one dtype. bf16 on XLA:CPU
    takes the fast form; anything else the plain product."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    out_dtype = jnp.dtype(out_dtype)
    if cpu_native.use_matvec(x, kernel):  # a single-stream decode on the CPU: float32 sums, rounded once
        return cpu_native.matvec(x, kernel).astype(out_dtype)
    if cpu_native.use_gemm(x, kernel):  # a float32 decode step of a few dozen sequences on the CPU
        return cpu_native.gemm(x, kernel).astype(out_dtype)
    if not applies(x.dtype):
        preferred = None if out_dtype == x.dtype else out_dtype
        return jax.lax.dot_general(x, kernel, dims, precision=precision, preferred_element_type=preferred)
    y = jax.lax.dot_general(_two_rows(x), kernel, dims, precision=precision, preferred_element_type=jnp.float32)
    return y[: x.shape[0]].astype(out_dtype)


def tied_logits(x: jax.Array, table: jax.Array, precision) -> jax.Array:
    """x [S, D] against the embedding table [V, D] -> logits [S, V] float32, for bf16 operands.

    The table is contracted on its minor axis. One row runs fast as a row times the transposed table; more rows
    run fast with the table as the left operand (the einsum below), and slow the other way round."""
    if x.shape[0] == 1:
        return jnp.dot(x, table.T, precision=precision, preferred_element_type=jnp.float32)
    return jnp.einsum("vd,sd->sv", table, x, precision=precision, preferred_element_type=jnp.float32)

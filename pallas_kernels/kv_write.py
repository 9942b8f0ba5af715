"""The KV write on GPU (Pallas, Triton lowering): this step's keys and values into their cache slots, in place.

A slot of the cache ``[N, P, K, D]`` is one contiguous row of K * D elements, so the write is T row copies.
Token-minor V pages ``[N, K, D, P]`` (kv_layout.py) take the same row as K * D elements P apart.
XLA's scatter (``reference.write_kv``) took 232-264 µs on the H200 for the 16384 rows of an 8 x 2048-token
prefill (67 MB of K and V: ~40 µs at copy speed), over a quarter of that attention call; this kernel took
29-31 µs (2026-11-29, docs/BENCHMARKS.md section 3). Each program copies ``TOKENS_PER_PROGRAM`` whole rows;
slots outside the cache (the engine's padding tokens) are skipped, like the scatter's ``mode="drop"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels import fp8

TOKENS_PER_PROGRAM = 4


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(num_kv_heads: int, head_dim: int) -> bool:
    """Triton blocks need power-of-two sizes: a whole row when K * D is one, else one head at a time."""
    return _is_pow2(num_kv_heads * head_dim) or _is_pow2(head_dim)


def _write_kernel(
    slots_ref, k_new_ref, v_new_ref, k_in_ref, v_in_ref, k_ref, v_ref, *, n_slots: int, head_dim: int, v_token_minor: bool
):
    del k_in_ref, v_in_ref  # aliased to k_ref and v_ref
    row = k_ref.shape[-1]
    # One piece per head when the row is not a power of two long (see `supported`).
    pieces = [(0, row)] if _is_pow2(row) else [(h * head_dim, head_dim) for h in range(row // head_dim)]
    for j in range(TOKENS_PER_PROGRAM):
        t = pl.program_id(0) * TOKENS_PER_PROGRAM + j
        slot = slots_ref[t]

        @pl.when((slot >= 0) & (slot < n_slots))
        def _():
            for start, size in pieces:
                k_ref[slot, pl.ds(start, size)] = k_new_ref[t, pl.ds(start, size)]
                if v_token_minor:
                    # v_ref [N, K * D, P]: the row lands strided, one element every P (lax: slot >= 0 here, and
                    # jnp's floor division adds a sign fix-up that the Triton lowering rejects).
                    page_size = v_ref.shape[-1]
                    blk, off = lax.div(slot, jnp.int32(page_size)), lax.rem(slot, jnp.int32(page_size))
                    v_ref[blk, pl.ds(start, size), off] = v_new_ref[t, pl.ds(start, size)]
                else:
                    v_ref[slot, pl.ds(start, size)] = v_new_ref[t, pl.ds(start, size)]


def write_kv_pallas(
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # [T] int32; out-of-range slots (padding) are dropped
    *,
    interpret: bool = False,
    k_scale=1.0,  # fp8 caches only: rows are quantized (scaled, clamped: fp8.quantize) before the copy
    v_scale=1.0,
    v_token_minor: bool = False,  # v_pages is [N, K, D, P] (kv_layout.py): each V row is a strided store
) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``reference.write_kv`` (in place when the cache is donated). An fp8 cache's new rows
    are quantized by XLA ahead of the kernel, a fusion over this step's T rows only; the kernel copies bytes."""
    n, p, k, d = k_pages.shape
    t = k_new.shape[0]
    t_pad = pl.cdiv(t, TOKENS_PER_PROGRAM) * TOKENS_PER_PROGRAM
    # Rows past T get slot -1: skipped, so their (out of bounds) new rows are never read.
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, t_pad - t), constant_values=-1)
    flat = lambda x, rows: x.reshape(rows, k * d)  # noqa: E731
    k_new, v_new = fp8.quantize(k_new, k_scale, k_pages.dtype), fp8.quantize(v_new, v_scale, v_pages.dtype)
    kernel = functools.partial(_write_kernel, n_slots=n * p, head_dim=d, v_token_minor=v_token_minor)
    v_view = v_pages.reshape(n, k * d, p) if v_token_minor else flat(v_pages, n * p)  # [N, K*D, P] or [N*P, K*D]
    k_out, v_out = pl.pallas_call(
        kernel,
        grid=(t_pad // TOKENS_PER_PROGRAM,),
        out_shape=[jax.ShapeDtypeStruct((n * p, k * d), k_pages.dtype), jax.ShapeDtypeStruct(v_view.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxserve_kv_write",
    )(slots, flat(k_new, t), flat(v_new, t), flat(k_pages, n * p), v_view)
    return k_out.reshape(n, p, k, d), v_out.reshape(v_pages.shape)

"""TPU path: the same entry-point contract, served by jax's ``ragged_paged_attention`` Pallas TPU op.

That op wants one combined cache ``kv_pages: [N, P, 2K, D]`` with keys at even and values at odd
head slots, while jaxserve keeps ``k_pages`` and ``v_pages`` apart. The adapter interleaves them per call,
a full copy of the layer's cache each step: correct, but a TPU deployment should store the cache
combined instead (a layout change in the runner, not in this interface).

An fp8 cache (fp8.py) goes to the op as fp8 pages. The op converts each K/V tile to q's dtype in the kernel when
given a scale, but takes only a static Python float; jaxserve's per-layer scales are traced values (loaded or
calibrated). So the op gets 1.0, and the real scales are folded outside it, as on the GPU (``fp8.fold_scale``).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import fp8
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.reference import write_kv


def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    interpret: bool = False,
    k_scale=1.0,  # fp8 caches only: per-layer scales (traced scalars or floats)
    v_scale=1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    is_fp8 = fp8.is_fp8(k_pages.dtype)
    if is_fp8 and k_pages.shape[2] % 2:
        # The op packs four fp8 values in a 32-bit word along its combined (2K) heads axis.
        raise ValueError(
            f"an fp8 KV cache on TPU needs an even number of KV heads per device (the TPU op packs 4 fp8 values a "
            f"word); this layer has {k_pages.shape[2]}: use kv_cache_dtype='auto', or attention_backend='xla'"
        )
    k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, md.slot_mapping, k_scale, v_scale)
    op_args = tpu_op_inputs(k_pages, v_pages, md)
    if is_fp8:
        q = fp8.fold_scale(q, k_scale)
    # On CPU the op runs through Pallas's TPU interpreter (tests); on a TPU it compiles with Mosaic.
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    # Off a TPU the op's tuning table cannot read a chip version, so the interpreter gets fixed blocks.
    blocks = dict(num_kv_pages_per_block=min(4, md.block_tables.shape[1]), num_queries_per_block=8)
    with ctx:
        out = ragged_paged_attention(
            q,
            *op_args,
            sm_scale=scale,
            sliding_window=sliding_window,
            # With a scale the op converts each fp8 tile to q's dtype; the real scales are folded outside.
            **(dict(k_scale=1.0, v_scale=1.0) if is_fp8 else {}),
            **(blocks if interpret else {}),
        )
    if is_fp8:
        out = fp8.fold_scale(out, v_scale)
    return out, k_pages, v_pages


def tpu_op_inputs(
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    md: AttentionMetadata,
) -> tuple[jax.Array, ...]:
    """The op's (kv_pages[N,P,2K,D], kv_lens[S], page_indices[S,B], cu_q_lens[S+1], num_seqs[1])."""
    n, p, kh, d = k_pages.shape
    kv_pages = jnp.stack([k_pages, v_pages], axis=3).reshape(n, p, 2 * kh, d)  # keys even, values odd
    # Padding sequences (seq_lens == 0) sit after the real ones, so the count of non-empty ones is the
    # op's dynamic sequence count.
    num_seqs = jnp.sum(md.seq_lens > 0, dtype=jnp.int32).reshape(1)  # [1]
    return kv_pages, md.seq_lens, md.block_tables, md.query_start_loc, num_seqs

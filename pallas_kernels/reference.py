"""Pure-jnp ragged paged attention: the ground truth every kernel is tested against.

KV cache layout (per layer): ``k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim]``.
A token's flat slot is ``block_id * block_size + offset``; reshaping a cache to
``[num_blocks * block_size, Hkv, D]`` turns a slot into a row index, which makes the write one scatter.

Shape letters: T tokens, S sequences, H query heads, K kv heads, G = H // K (query heads per kv head),
D head dim, B blocks per sequence (block-table width), P block size, C = B * P context slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import fp8
from jaxserve.pallas_kernels import precision as prec
from jaxserve.pallas_kernels.metadata import AttentionMetadata

# Large negative instead of -inf: a fully masked row (a padding token) then gives a finite, ignored output.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def write_kv(
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # [T] int32; out-of-range slots (padding) are dropped
    k_scale=1.0,  # fp8 caches only: stored values are x / scale, clipped (fp8.quantize)
    v_scale=1.0,
    v_token_minor: bool = False,  # v_pages is [N, K, D, P] (kv_layout.py)
    heads_major: bool = False,  # both are [N, K, P, D] (kv_layout.py; the xla backend's cache)
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys and values into their cache slots (in place when the cache is donated)."""
    n, p, k, d = k_pages.shape
    if heads_major:
        n, k, p, d = k_pages.shape
    if slot_mapping.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice guarded by a read of the old row
        # (for mode="drop"), and that read makes it copy the whole donated cache three times per layer:
        # a 1-token step measured 790 ms against 39 ms at 2 tokens on CPU. A second, dropped row keeps
        # it a scatter, which updates in place.
        k_new, v_new = _with_dropped_row(k_new), _with_dropped_row(v_new)  # [2, K, D]
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), n * p, slot_mapping.dtype)])  # [2]
    k_new, v_new = fp8.quantize(k_new, k_scale, k_pages.dtype), fp8.quantize(v_new, v_scale, v_pages.dtype)
    if heads_major:
        # A slot is (block, offset), the offset on axis 2. Out-of-range slots have an out-of-range block
        # (slot // P >= N), so mode="drop" still drops them. Indexed as [blk, :, off] the update is [T, K, D].
        blk, off = slot_mapping // p, slot_mapping % p  # [T]
        return k_pages.at[blk, :, off].set(k_new, mode="drop"), v_pages.at[blk, :, off].set(v_new, mode="drop")
    k_flat = k_pages.reshape(n * p, k, d).at[slot_mapping].set(k_new, mode="drop")
    if v_token_minor:
        # A slot is (block, offset): the offset indexes the last axis. Out-of-range slots have an
        # out-of-range block (slot // P >= N), so mode="drop" still drops them.
        blk, off = slot_mapping // p, slot_mapping % p  # [T]
        return k_flat.reshape(n, p, k, d), v_pages.at[blk, :, :, off].set(v_new, mode="drop")
    v_flat = v_pages.reshape(n * p, k, d).at[slot_mapping].set(v_new, mode="drop")
    return k_flat.reshape(n, p, k, d), v_flat.reshape(n, p, k, d)


def _with_dropped_row(x: jax.Array) -> jax.Array:  # [1, K, D] -> [2, K, D]
    return jnp.concatenate([x, x], axis=0)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [N, P, K, D] (already holding this step's keys)
    v_pages: jax.Array,  # [N, P, K, D]
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
    k_scale=1.0,  # fp8 caches: what the stored values are multiplied by when read (fp8.dequantize)
    v_scale=1.0,
) -> jax.Array:  # [T, H, D]
    """Causal attention of each new token over its own sequence's cached context.

    Each token gathers its sequence's pages (T x C x K x D): simple and exact, not fast. A kernel avoids
    the gather; this is what it must agree with. ``precision`` (of both products): None picks it from q's
    dtype (``precision.resolve``), so a float32 model's attention is float32 on a GPU too, not TF32.
    """
    precision = prec.resolve(precision, q.dtype)
    t, h, d = q.shape
    _, p, kh, _ = k_pages.shape
    g = h // kh
    b = md.block_tables.shape[1]
    c = b * p

    tables = md.block_tables[md.token_seq_ids]  # [T, B]
    k_ctx = k_pages[tables].reshape(t, c, kh, d)  # [T, C, K, D]
    v_ctx = v_pages[tables].reshape(t, c, kh, d)
    qg = q.reshape(t, kh, g, d).astype(jnp.float32)

    scores = jnp.einsum("tkgd,tckd->tkgc", qg, fp8.dequantize(k_ctx, k_scale), precision=precision) * scale  # [T, K, G, C]
    ctx_pos = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    q_pos = md.positions[:, None]  # [T, 1]
    seq_len = md.seq_lens[md.token_seq_ids][:, None]  # [T, 1]
    visible = (ctx_pos <= q_pos) & (ctx_pos < seq_len)  # [T, C]
    if sliding_window is not None:
        visible &= ctx_pos > q_pos - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None, None, :], probs, 0.0)
    out = jnp.einsum("tkgc,tckd->tkgd", probs, fp8.dequantize(v_ctx, v_scale), precision=precision)
    return out.reshape(t, h, d).astype(q.dtype)

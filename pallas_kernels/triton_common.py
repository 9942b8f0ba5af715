"""Pieces shared by the GPU (Pallas/Triton) attention kernels: the online-softmax step and KV-tile loads.

Both kernels see the cache as whole-array refs ``k_pages, v_pages: [N, P, K, D]`` and gather one tile of
``pages_per_tile`` pages for one KV head at a time, so every query head of a group shares the same read.
Rows of a query tile are ``(token, head-in-group)`` pairs flattened token-major: row r is token r // Gp.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Same finite mask as the reference: a fully masked row stays finite (its output is ignored).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


def load_kv_tile(
    pages_ref, tables_ref, seq, tok0, kv_head, tile_tokens: int, seq_len=None, mask_mode="none", dtype=None
):
    """K or V of context tokens [tok0, tok0 + TK) of one sequence and one KV head: [TK, D].

    An fp8 cache's tile is converted to ``dtype`` (the query's) in registers, right after the load: the
    products then take one operand type. Its scale is not applied here: the caller folds it into q and the
    output (fp8.py), which costs nothing per tile.
    tok0 is a multiple of TK. A tile of whole pages gathers TK // P pages through the block table; a
    tile smaller than a page (big pages, fp32) reads a slice of one page. ``mask_mode`` zeroes tokens at
    or past ``seq_len`` ("where": after the load; "load": a masked load) so that stale NaNs cannot reach
    a product with a zero probability; "none" leaves them, as the reference does.
    """
    page_size = pages_ref.shape[1]
    if tile_tokens >= page_size:
        page_ids = tables_ref[seq, pl.ds(tok0 // page_size, tile_tokens // page_size)]  # [TK // P]
        idx = (page_ids, slice(None), kv_head, slice(None))
        shape = (tile_tokens // page_size, page_size, pages_ref.shape[-1])  # [TK // P, P, D]
    else:
        # lax.rem, not %: jnp's floor-mod adds a sign fix-up that the Triton lowering rejects; tok0 >= 0.
        in_page = lax.rem(tok0, jnp.int32(page_size))
        idx = (tables_ref[seq, tok0 // page_size], pl.ds(in_page, tile_tokens), kv_head, slice(None))
        shape = (tile_tokens, pages_ref.shape[-1])  # [TK, D]
    if mask_mode == "load":
        pos = tok0 + lax.broadcasted_iota(jnp.int32, shape, 0) * (shape[1] if len(shape) == 3 else 1)
        if len(shape) == 3:
            pos += lax.broadcasted_iota(jnp.int32, shape, 1)
        tile = plgpu.load(pages_ref.at[idx], mask=pos < seq_len, other=0)
    else:
        tile = pages_ref[idx]
    tile = tile.reshape(tile_tokens, shape[-1])  # [TK, D]
    if dtype is not None and tile.dtype != dtype:
        tile = tile.astype(dtype)  # before the mask: fp8 selects are not worth relying on in Triton
    if mask_mode == "where":
        in_seq = (tok0 + lax.broadcasted_iota(jnp.int32, (tile_tokens, 1), 0)) < seq_len  # [TK, 1]
        tile = jnp.where(in_seq, tile, 0)
    return tile


def load_v_tile_token_minor(
    vt_ref, tables_ref, seq, tok0, kv_head, tile_tokens: int, seq_len=None, mask_mode="none", dtype=None
):
    """V of context tokens [tok0, tok0 + TK) from a token-minor cache ``[N, K, D, P]``, transposed: [D, TK].

    Why: P·V sums over tokens, so the tensor cores want V's B operand as pairs of consecutive *tokens* per
    head-dim column. A token-major fp8 tile is contiguous along D, and Hopper's transposed shared-memory
    load takes only 16-bit elements, so Triton reshapes it with byte permutes; a token-minor tile is already
    in the operand's order. Same contract as ``load_kv_tile`` otherwise (conversion to ``dtype``, masks).
    """
    page_size, head_dim = vt_ref.shape[-1], vt_ref.shape[-2]
    if tile_tokens >= page_size:
        n_pages = tile_tokens // page_size
        page_ids = tables_ref[seq, pl.ds(tok0 // page_size, n_pages)]  # [TK // P]
        idx = (page_ids, kv_head, slice(None), slice(None))
        shape = (n_pages, head_dim, page_size)  # [TK // P, D, P]
    else:
        in_page = lax.rem(tok0, jnp.int32(page_size))
        idx = (tables_ref[seq, tok0 // page_size], kv_head, slice(None), pl.ds(in_page, tile_tokens))
        shape = (head_dim, tile_tokens)  # [D, TK]
    if mask_mode == "load":
        pos = tok0 + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
        if len(shape) == 3:
            pos += lax.broadcasted_iota(jnp.int32, shape, 0) * page_size
        tile = plgpu.load(vt_ref.at[idx], mask=pos < seq_len, other=0)
    else:
        tile = vt_ref[idx]
    if dtype is not None and tile.dtype != dtype:
        tile = tile.astype(dtype)
    if mask_mode == "where":  # in the loaded layout, before the transpose: the selects then need no shuffles
        if len(shape) == 3:
            pos = tok0 + lax.broadcasted_iota(jnp.int32, (shape[0], 1, page_size), 0) * page_size
            pos += lax.broadcasted_iota(jnp.int32, (shape[0], 1, page_size), 2)  # [TK // P, 1, P]
        else:
            pos = tok0 + lax.broadcasted_iota(jnp.int32, (1, tile_tokens), 1)  # [1, TK]
        tile = jnp.where(pos < seq_len, tile, 0)
    if len(shape) == 3:
        tile = jnp.transpose(tile, (1, 0, 2)).reshape(head_dim, tile_tokens)  # [D, TK]
    return tile


def pick_tile_tokens(requested: int, head_dim: int, itemsize: int, stages: int, budget: int = 128 * 1024) -> int:
    """Largest power of two <= requested whose pipelined K and V buffers fit the shared-memory budget."""
    fit = budget // (2 * head_dim * itemsize * stages)
    tile = 1 << (min(requested, max(fit, 16)).bit_length() - 1)
    return max(tile, 16)  # 16 rows: the smallest MMA operand


def online_softmax_step(q, k, v, visible, carry, *, scale: float, precision, v_token_minor: bool = False):
    """One flash-attention update of (acc[M,D], m[M], l[M]) with a K/V tile of TK tokens.

    q: [M, D]; k: [TK, D]; v: [TK, D], or [D, TK] with ``v_token_minor`` (``load_v_tile_token_minor``);
    visible: [M, TK] bool, or None when nothing in the tile is masked.
    ``precision`` of both products: Triton runs HIGHEST float32 as IEEE float32, DEFAULT and HIGH as TF32;
    bf16 operands ignore it.
    """
    acc, m_prev, l_prev = carry
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [M, TK] f32
    if visible is not None:  # None: every row sees the whole tile
        s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))  # [M]
    # exp2 with a folded log2(e): one multiply instead of the exp's range reduction.
    alpha = jnp.exp2((m_prev - m_next) * _LOG2E)  # [M]
    p = jnp.exp2((s - m_next[:, None]) * _LOG2E)  # [M, TK]
    l_next = alpha * l_prev + p.sum(axis=-1)
    pv = plgpu.dot(p.astype(v.dtype), v, trans_b=v_token_minor, precision=precision)  # [M, D] f32
    return acc * alpha[:, None] + pv, m_next, l_next


def init_carry(rows: int, head_dim: int):
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    # Start below MASK_VALUE so that the first tile, even if fully masked, sets m.
    m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    return acc, m, l


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())

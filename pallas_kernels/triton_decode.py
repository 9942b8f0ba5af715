"""Decode-path kernel (Pallas, Triton lowering): sequences with a few new tokens, context split in parts.

Grid: (sequence s, KV head k, context split j). One program packs the query heads of KV head k for up to
``q_per_seq`` new tokens of s into one row tile (QA tokens x Gp heads >= 16 rows, the smallest tile the
tensor cores take), so each KV page is read once per KV head. Split j walks context tokens
``[j * tokens_per_split, (j + 1) * tokens_per_split)`` and writes an unnormalised partial result plus its
running max and sum; ``merge_splits`` combines them. Sequences with more than ``q_per_seq`` new tokens
(prefill chunks) are left to the prefill kernel: their programs do no work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels import triton_common as tc


def _decode_kernel(
    qsl_ref,  # [S+1] int32 query_start_loc
    seq_lens_ref,  # [S] int32
    tables_ref,  # [S, Bp] int32, padded to cover num_splits * tokens_per_split
    q_ref,  # [T + QA, K, Gp, D]
    k_ref,  # [N, P, K, D]
    v_ref,  # [N, P, K, D]
    acc_ref,  # out [num_splits, S, K, M, D] f32
    m_ref,  # out [num_splits, S, K, M] f32
    l_ref,  # out [num_splits, S, K, M] f32
    *,
    scale: float,
    q_per_seq: int,
    tile_tokens: int,
    tokens_per_split: int,
    sliding_window: int | None,
    v_mask: str,
):
    s, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = k_ref.shape[-1]
    gp = q_ref.shape[2]
    rows = q_per_seq * gp

    q_start = qsl_ref[s]
    q_len = qsl_ref[s + 1] - q_start
    seq_len = seq_lens_ref[s]
    active = (q_len > 0) & (q_len <= q_per_seq)

    q = q_ref[pl.ds(q_start, q_per_seq), kh, :, :].reshape(rows, head_dim)  # [M, D]
    row_tok = lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 0) // gp  # [M, TK]
    q_pos = seq_len - q_len + row_tok  # [M, TK] position of each row's token

    lo = split * tokens_per_split
    if sliding_window is not None:
        # Tiles wholly before every row's window are skipped; the mask trims the rest.
        win_lo = jnp.maximum(seq_len - q_len - sliding_window + 1, 0)
        lo = jnp.maximum(lo, (win_lo // tile_tokens) * tile_tokens)
    hi = jnp.minimum(seq_len, (split + 1) * tokens_per_split)
    n_tiles = jnp.where(active, pl.cdiv(jnp.maximum(hi - lo, 0), tile_tokens), 0)
    precision = tc.dot_precision(q_ref.dtype)

    def body(i, carry):
        tok0 = lo + i * tile_tokens
        kv_pos = tok0 + lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 1)  # [M, TK]
        # K needs no masking (masked logits are replaced); V does unless v_mask is "none".
        k = tc.load_kv_tile(k_ref, tables_ref, s, tok0, kh, tile_tokens)  # [TK, D]
        v = tc.load_kv_tile(v_ref, tables_ref, s, tok0, kh, tile_tokens, seq_len, v_mask)  # [TK, D]
        visible = kv_pos <= q_pos
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        return tc.online_softmax_step(q, k, v, visible, carry, scale=scale, precision=precision)

    acc, m, l = lax.fori_loop(0, n_tiles, body, tc.init_carry(rows, head_dim))
    acc_ref[split, s, kh, :, :] = acc
    m_ref[split, s, kh, :] = m
    l_ref[split, s, kh, :] = l


def decode_partials(
    q_p: jax.Array,  # [T + QA, K, Gp, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    query_start_loc: jax.Array,  # [S+1]
    seq_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, B]
    *,
    scale: float,
    q_per_seq: int,
    tile_tokens: int,
    num_splits: int,
    sliding_window: int | None,
    v_mask: str,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """Run the split-context decode kernel: returns (acc[J,S,K,M,D], m[J,S,K,M], l[J,S,K,M]) in f32."""
    s_count, width = block_tables.shape
    page_size = k_pages.shape[1]
    kh_count, gp, head_dim = q_p.shape[1:]
    rows = q_per_seq * gp
    step = max(tile_tokens, page_size)
    tokens_per_split = pl.cdiv(pl.cdiv(width * page_size, num_splits), step) * step
    # Pad the table so every tile's page ids are in bounds; padded pages lie past seq_len and are masked.
    padded_width = pl.cdiv(num_splits * tokens_per_split, page_size)
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - width)))
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        q_per_seq=q_per_seq,
        tile_tokens=tile_tokens,
        tokens_per_split=tokens_per_split,
        sliding_window=sliding_window,
        v_mask=v_mask,
    )
    part_shape = (num_splits, s_count, kh_count, rows)
    return pl.pallas_call(
        kernel,
        grid=(s_count, kh_count, num_splits),
        out_shape=[
            jax.ShapeDtypeStruct((*part_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_paged_decode",
    )(query_start_loc, seq_lens, tables, q_p, k_pages, v_pages)


def merge_splits(
    acc: jax.Array,  # [J, S, K, M, D] f32
    m: jax.Array,  # [J, S, K, M]
    l: jax.Array,  # [J, S, K, M]
) -> jax.Array:  # [S, K, M, D] f32
    """Combine the context splits' partial softmaxes (log-sum-exp rescaling)."""
    m_all = m.max(axis=0)  # [S, K, M]
    w = jnp.exp(m - m_all[None])  # [J, S, K, M]
    num = (acc * w[..., None]).sum(axis=0)
    den = (l * w).sum(axis=0)
    # Inactive programs leave l == 0; keep their (ignored) rows finite.
    return num / jnp.where(den > 0, den, 1.0)[..., None]

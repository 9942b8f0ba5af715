"""Prefill/extend-path kernel (Pallas, Triton lowering): causal flash attention over the paged cache.

Grid: (query block b, KV head k). Query block b is ``block_q`` consecutive new tokens of one sequence
(the schedule ``query_block_schedule`` builds from the metadata), all Gp query heads of KV head k packed
as rows, so a KV tile loaded once serves ``block_q * Gp`` rows. The KV loop stops at the block's last
token (causal) and starts at its window (sliding window). The grid is sized from static shapes alone:
at most ``cdiv(T, block_q) + S`` blocks can be needed; blocks past the schedule do no work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.pallas_kernels import precision as prec
from jaxserve.pallas_kernels import triton_common as tc


def query_block_schedule(
    query_start_loc: jax.Array,  # [S+1]
    is_prefill_seq: jax.Array,  # [S] bool: sequences this kernel handles
    *,
    block_q: int,
    num_blocks: int,
) -> tuple[jax.Array, jax.Array]:
    """Map each grid block to (sequence, first query offset in that sequence); unused blocks get seq S."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    n_blk = jnp.where(is_prefill_seq, pl.cdiv(q_lens, block_q), 0)  # [S]
    ends = jnp.cumsum(n_blk)  # [S]
    b = jnp.arange(num_blocks, dtype=jnp.int32)  # [NB]
    # compare_all: one fused compare-and-count; the default binary search is a loop of tiny launches.
    blk_seq = jnp.searchsorted(ends, b, side="right", method="compare_all").astype(jnp.int32)  # [NB], S if unused
    starts = ends - n_blk
    used = blk_seq < q_lens.shape[0]
    # Unused blocks start at offset 0 of the empty sequence S, so their loads stay inside q's padding.
    blk_off = jnp.where(used, (b - starts[jnp.minimum(blk_seq, q_lens.shape[0] - 1)]) * block_q, 0)  # [NB]
    return blk_seq, blk_off.astype(jnp.int32)


def _prefill_kernel(
    blk_seq_ref,  # [NB] int32
    blk_off_ref,  # [NB] int32
    qsl_ref,  # [S+2] int32 (query_start_loc plus a repeated end, for the unused-block sequence S)
    seq_lens_ref,  # [S+1] int32 (0 for sequence S)
    tables_ref,  # [S+1, Bp] int32
    q_ref,  # [T + BQ, K, Gp, D]
    k_ref,  # [N, P, K, D]
    v_ref,  # [N, P, K, D], or [N, K, D, P] with v_token_minor
    o_ref,  # out [T + BQ, K, Gp, D]
    *,
    scale: float,
    block_q: int,
    tile_tokens: int,
    sliding_window: int | None,
    v_mask: str,
    precision: lax.Precision | None,
    v_token_minor: bool = False,
):
    b, kh = pl.program_id(0), pl.program_id(1)
    head_dim = k_ref.shape[-1]
    gp = q_ref.shape[2]
    rows = block_q * gp

    s = blk_seq_ref[b]
    q_off = blk_off_ref[b]
    q_start = qsl_ref[s]
    q_len = qsl_ref[s + 1] - q_start
    seq_len = seq_lens_ref[s]
    tok0 = q_start + q_off  # first flat token of this block
    n_valid = jnp.minimum(q_len - q_off, block_q)  # tokens of this block that are real (<= 0: none)

    # Blocks past the schedule (and the empty prefill launch of a pure-decode step) skip everything.
    @pl.when(n_valid > 0)
    def _():
        pos0 = seq_len - q_len + q_off  # position of the block's first token
        q = q_ref[pl.ds(tok0, block_q), kh, :, :].reshape(rows, head_dim)  # [M, D]
        row_tok = lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 0) // gp  # [M, TK]
        q_pos = pos0 + row_tok  # [M, TK]

        hi = jnp.minimum(seq_len, pos0 + n_valid)  # causal end (exclusive)
        lo_tile = 0
        if sliding_window is not None:
            lo_tile = jnp.maximum(pos0 - sliding_window + 1, 0) // tile_tokens
        end_tile = pl.cdiv(hi, tile_tokens)
        # Tiles every row sees in full (before the block's first position) skip the mask; only the
        # diagonal tiles (and every tile under a sliding window) pay for it.
        full_end = lo_tile if sliding_window is not None else jnp.minimum((pos0 + 1) // tile_tokens, end_tile)

        load_v = tc.load_v_tile_token_minor if v_token_minor else tc.load_kv_tile  # [D, TK] or [TK, D]
        step = functools.partial(tc.online_softmax_step, scale=scale, precision=precision, v_token_minor=v_token_minor)

        def body(tile, carry, masked: bool):
            t0 = tile * tile_tokens
            # K needs no masking (masked logits are replaced); V does unless v_mask is "none".
            k = tc.load_kv_tile(k_ref, tables_ref, s, t0, kh, tile_tokens, dtype=q.dtype)  # [TK, D]
            if not masked:
                v = load_v(v_ref, tables_ref, s, t0, kh, tile_tokens, dtype=q.dtype)  # all tokens < seq_len
                return step(q, k, v, None, carry)
            v = load_v(v_ref, tables_ref, s, t0, kh, tile_tokens, seq_len, v_mask, q.dtype)
            kv_pos = t0 + lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 1)  # [M, TK]
            visible = kv_pos <= q_pos
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
            return step(q, k, v, visible, carry)

        carry = lax.fori_loop(lo_tile, full_end, functools.partial(body, masked=False), tc.init_carry(rows, head_dim))
        acc, _, l = lax.fori_loop(jnp.maximum(full_end, lo_tile), end_tile, functools.partial(body, masked=True), carry)
        out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype).reshape(block_q, gp, head_dim)
        # Rows past the block's real tokens belong to the next sequence's block: never write them.
        tok_ok = lax.broadcasted_iota(jnp.int32, (block_q, gp, head_dim), 0) < n_valid
        plgpu.store(o_ref.at[pl.ds(tok0, block_q), kh, :, :], out, mask=tok_ok)


def prefill_attention(
    q_p: jax.Array,  # [T + BQ, K, Gp, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D], or [N, K, D, P] with v_token_minor
    query_start_loc: jax.Array,  # [S+1]
    seq_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, B]
    is_prefill_seq: jax.Array,  # [S] bool
    *,
    num_tokens: int,
    max_prefill_seqs: int | None = None,
    scale: float,
    block_q: int,
    tile_tokens: int,
    sliding_window: int | None,
    v_mask: str,
    num_warps: int,
    num_stages: int,
    precision: lax.Precision | None = None,  # of the kernel's products; None: from q's dtype (precision.resolve)
    v_token_minor: bool = False,  # V pages are [N, K, D, P] (kv_layout.py)
    interpret: bool,
) -> jax.Array:  # [T + BQ, K, Gp, D]; rows of tokens it does not own are unwritten
    s_count, width = block_tables.shape
    # Each prefill sequence adds at most one partial block; max_prefill_seqs (at most T // (QA + 1) when
    # decodes take up to QA tokens) keeps a pure-decode step's empty launch small.
    num_blocks = pl.cdiv(num_tokens, block_q) + (s_count if max_prefill_seqs is None else min(s_count, max_prefill_seqs))
    blk_seq, blk_off = query_block_schedule(
        query_start_loc, is_prefill_seq, block_q=block_q, num_blocks=num_blocks
    )
    # Sequence S is the "no work" sequence for unused blocks: empty query range, no context.
    qsl = jnp.concatenate([query_start_loc, query_start_loc[-1:]])  # [S+2]
    lens = jnp.concatenate([seq_lens, jnp.zeros((1,), seq_lens.dtype)])  # [S+1]
    page_size = k_pages.shape[1]
    padded_width = pl.cdiv(pl.cdiv(width * page_size, tile_tokens) * tile_tokens, page_size)
    tables = jnp.pad(block_tables, ((0, 1), (0, padded_width - width)))  # [S+1, Bp]
    kernel = functools.partial(
        _prefill_kernel,
        scale=scale,
        block_q=block_q,
        tile_tokens=tile_tokens,
        sliding_window=sliding_window,
        v_mask=v_mask,
        precision=prec.resolve(precision, q_p.dtype),
        v_token_minor=v_token_minor,
    )
    return pl.pallas_call(
        kernel,
        grid=(num_blocks, q_p.shape[1]),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q_p.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_paged_prefill",
    )(blk_seq, blk_off, qsl, lens, tables, q_p, k_pages, v_pages)

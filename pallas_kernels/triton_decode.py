"""Decode-path kernel (Pallas, Triton lowering): sequences with a few new tokens, context split in parts.

Grid: (KV head k, sequence s, context split j), KV head fastest so that the K programs of one sequence
run side by side and read the same pages (adjacent 256-byte rows of each token's [K, D] slab). One
program packs the query heads of KV head k for up to ``q_per_seq`` new tokens of s into one row tile
(QA tokens x Gp heads >= 16 rows, the smallest tile the tensor cores take), so each KV page is read
once per KV head. Split j walks context tokens ``[j * tokens_per_split, (j + 1) * tokens_per_split)``.

Only the rows of a sequence's real tokens are stored, straight into a token-indexed output
``[T(+QA), K, Gp, D]`` in the query dtype. That buffer may be the prefill kernel's output, passed in and
aliased, so that one buffer ends up holding every token's row with no routing pass. With one split the
kernel normalises and stores its rows itself; with several it stores unnormalised f32 partials per
sequence plus their running max and sum, and a second small kernel (``_merge_kernel``) combines them
and stores the rows. Sequences with more than ``q_per_seq`` new tokens (prefill chunks) are left to the
prefill kernel: their programs do no work and leave their rows alone.
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


def _decode_kernel(
    qsl_ref,  # [S+1] int32 query_start_loc
    seq_lens_ref,  # [S] int32
    tables_ref,  # [S, Bp] int32, padded to cover num_splits * tokens_per_split
    q_ref,  # [T (+ QA), K, Gp, D]
    k_ref,  # [N, P, K, D]
    v_ref,  # [N, P, K, D], or [N, K, D, P] with v_token_minor
    *refs,  # (aliased buffer in,) then out: o [T(+QA), K, Gp, D], or acc [J, S, K, M, D] f32, m and l [J, S, K, M] f32
    scale: float,
    q_per_seq: int,
    tile_tokens: int,
    tokens_per_split: int,
    sliding_window: int | None,
    v_mask: str,
    heads_inner: bool,
    aliased: bool,
    precision: lax.Precision | None,
    compute_dtype=None,
    mask_tail_only: bool = False,
    v_token_minor: bool = False,
):
    out_refs = refs[1:] if aliased else refs
    if heads_inner:
        kh, s, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        s, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = k_ref.shape[-1]
    gp = q_ref.shape[2]
    rows = q_per_seq * gp

    q_start = qsl_ref[s]
    q_len = qsl_ref[s + 1] - q_start
    seq_len = seq_lens_ref[s]
    active = (q_len > 0) & (q_len <= q_per_seq)

    # Rows past the sequence's tokens are masked: q may end right after its last token (no padding rows).
    tok_ok = active & (lax.broadcasted_iota(jnp.int32, (q_per_seq, gp), 0) < q_len)  # [QA, Gp]
    q_mask = jnp.broadcast_to(tok_ok[:, :, None], (q_per_seq, gp, head_dim))
    q = plgpu.load(q_ref.at[pl.ds(q_start, q_per_seq), kh, :, :], mask=q_mask, other=0).reshape(rows, head_dim)
    if compute_dtype is not None:
        q = q.astype(compute_dtype)
    row_tok = lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 0) // gp  # [M, TK]
    q_pos = seq_len - q_len + row_tok  # [M, TK] position of each row's token

    lo = split * tokens_per_split
    if sliding_window is not None:
        # Tiles wholly before every row's window are skipped; the mask trims the rest.
        win_lo = jnp.maximum(seq_len - q_len - sliding_window + 1, 0)
        lo = jnp.maximum(lo, (win_lo // tile_tokens) * tile_tokens)
    hi = jnp.minimum(seq_len, (split + 1) * tokens_per_split)
    n_tiles = jnp.where(active, pl.cdiv(jnp.maximum(hi - lo, 0), tile_tokens), 0)

    load_v = tc.load_v_tile_token_minor if v_token_minor else tc.load_kv_tile

    def body(i, carry, masked=True):
        tok0 = lo + i * tile_tokens
        # K needs no masking (masked logits are replaced); V does unless v_mask is "none".
        k = tc.load_kv_tile(k_ref, tables_ref, s, tok0, kh, tile_tokens, dtype=q.dtype)  # [TK, D]
        v_mode = v_mask if masked else "none"
        v = load_v(v_ref, tables_ref, s, tok0, kh, tile_tokens, seq_len, v_mode, q.dtype)  # [TK, D] or [D, TK]
        visible = None
        if masked:
            kv_pos = tok0 + lax.broadcasted_iota(jnp.int32, (rows, tile_tokens), 1)  # [M, TK]
            visible = kv_pos <= q_pos
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
        return tc.online_softmax_step(
            q, k, v, visible, carry, scale=scale, precision=precision, v_token_minor=v_token_minor
        )

    carry = tc.init_carry(rows, head_dim)
    n_full = 0
    if mask_tail_only and sliding_window is None:
        # Tiles that end at or before the first row's position are seen whole by every row and hold no token
        # past seq_len: they skip the logit and V selects, which cost the fp8 loop ~7% of its time.
        n_full = jnp.minimum(lax.div(jnp.maximum(seq_len - q_len + 1 - lo, 0), jnp.int32(tile_tokens)), n_tiles)
        carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(n_full, n_tiles, body, carry)
    # Only the rows of this sequence's real tokens are stored: the next rows belong to other sequences.
    if len(out_refs) == 1:  # one split: normalise here and store the final rows
        (o_ref,) = out_refs
        out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype).reshape(q_per_seq, gp, head_dim)
        plgpu.store(o_ref.at[pl.ds(q_start, q_per_seq), kh, :, :], out, mask=tok_ok[:, :, None])
        return
    acc_ref, m_ref, l_ref = out_refs
    row_ok = tok_ok.reshape(rows)
    plgpu.store(acc_ref.at[split, s, kh, :, :], acc, mask=row_ok[:, None])
    plgpu.store(m_ref.at[split, s, kh, :], m, mask=row_ok)
    plgpu.store(l_ref.at[split, s, kh, :], l, mask=row_ok)


def _merge_kernel(
    qsl_ref,  # [S+1] int32
    acc_ref,  # [J, S, K, M, D] f32
    m_ref,  # [J, S, K, M] f32
    l_ref,  # [J, S, K, M] f32
    *refs,  # (aliased buffer in,) out o [T(+QA), K, Gp, D]
    q_per_seq: int,
    aliased: bool,
):
    """Combine one (sequence, KV head)'s split partials (log-sum-exp rescaling) and store its rows."""
    o_ref = refs[-1]
    kh, s = pl.program_id(0), pl.program_id(1)
    num_splits, rows, head_dim = acc_ref.shape[0], acc_ref.shape[3], acc_ref.shape[4]
    gp = rows // q_per_seq
    q_start = qsl_ref[s]
    q_len = qsl_ref[s + 1] - q_start
    tok_ok = (q_len <= q_per_seq) & (lax.broadcasted_iota(jnp.int32, (q_per_seq, gp), 0) < q_len)  # [QA, Gp]
    row_ok = tok_ok.reshape(rows)

    @pl.when((q_len > 0) & (q_len <= q_per_seq))
    def _():
        def load(ref, j):  # rows past the sequence's tokens were never written: read them as zeros
            if len(ref.shape) == 5:
                return plgpu.load(ref.at[j, s, kh, :, :], mask=row_ok[:, None], other=0.0)
            return plgpu.load(ref.at[j, s, kh, :], mask=row_ok, other=0.0)

        m_all = lax.fori_loop(0, num_splits, lambda j, mx: jnp.maximum(mx, load(m_ref, j)), load(m_ref, jnp.int32(0)))

        def add(j, carry):
            num, den = carry
            w = jnp.exp(load(m_ref, j) - m_all)  # [M]
            return num + load(acc_ref, j) * w[:, None], den + load(l_ref, j) * w

        num, den = lax.fori_loop(
            0, num_splits, add, (jnp.zeros((rows, head_dim), jnp.float32), jnp.zeros((rows,), jnp.float32))
        )
        out = (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(o_ref.dtype).reshape(q_per_seq, gp, head_dim)
        plgpu.store(o_ref.at[pl.ds(q_start, q_per_seq), kh, :, :], out, mask=tok_ok[:, :, None])


def decode_attention(
    q_p: jax.Array,  # [T (+ QA), K, Gp, D]: padding rows only for interpret mode (it clamps row windows)
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D], or [N, K, D, P] with v_token_minor
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
    heads_inner: bool = True,
    precision: lax.Precision | None = None,  # of the kernel's products; None: from q's dtype (precision.resolve)
    # The products' operand type when it is not q's: float16 over an fp8 cache, whose tiles convert to
    # float16 in fewer instructions than to bfloat16 (e5m2 is float16's top byte).
    compute_dtype=None,
    # Mask logits and V only in the tiles that need it (those reaching past the first row's position).
    mask_tail_only: bool = False,
    # V pages are token-minor, [N, K, D, P] (kv_layout.py): P·V's operand comes without byte permutes.
    v_token_minor: bool = False,
    out: jax.Array | None = None,  # [T', K, Gp, D]: write the decode rows into this buffer (aliased)
    interpret: bool,
) -> jax.Array:  # `out` with the decode tokens' rows written, else a new [T + QA, K, Gp, D] holding only those
    """Run the split-context decode kernel (and, with several splits, the merge kernel)."""
    s_count, width = block_tables.shape
    page_size = k_pages.shape[1]
    kh_count, gp, head_dim = q_p.shape[1:]
    rows = q_per_seq * gp
    step = max(tile_tokens, page_size)
    tokens_per_split = pl.cdiv(pl.cdiv(width * page_size, num_splits), step) * step
    # Pad the table so every tile's page ids are in bounds; padded pages lie past seq_len and are masked.
    padded_width = pl.cdiv(num_splits * tokens_per_split, page_size)
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - width)))
    aliased = out is not None
    out_struct = jax.ShapeDtypeStruct(out.shape if aliased else q_p.shape, q_p.dtype)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    single = num_splits == 1
    kernel = functools.partial(
        _decode_kernel,
        scale=scale,
        q_per_seq=q_per_seq,
        tile_tokens=tile_tokens,
        tokens_per_split=tokens_per_split,
        sliding_window=sliding_window,
        v_mask=v_mask,
        heads_inner=heads_inner,
        compute_dtype=compute_dtype,
        mask_tail_only=mask_tail_only,
        v_token_minor=v_token_minor,
        aliased=aliased and single,
        precision=prec.resolve(precision, q_p.dtype),
    )
    if single:
        out_shape = [out_struct]
    else:
        part = (num_splits, s_count, kh_count, rows)
        out_shape = [
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ]
    args = (query_start_loc, seq_lens, tables, q_p, k_pages, v_pages)
    grid = (kh_count, s_count, num_splits) if heads_inner else (s_count, kh_count, num_splits)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases={len(args): 0} if aliased and single else {},
        compiler_params=params,
        interpret=interpret,
        name="jaxserve_paged_decode",
    )(*args, *((out,) if aliased and single else ()))
    if single:
        return outs[0]
    merge = functools.partial(_merge_kernel, q_per_seq=q_per_seq, aliased=aliased)
    return pl.pallas_call(
        merge,
        grid=(kh_count, s_count),
        out_shape=out_struct,
        input_output_aliases={4: 0} if aliased else {},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxserve_decode_merge",
    )(query_start_loc, *outs, *((out,) if aliased else ()))

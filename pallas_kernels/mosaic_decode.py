"""Decode kernel for Hopper over an fp8 KV cache (Pallas, Mosaic GPU lowering): TMA ring, wgmma, KV tile as rows.

Why a second decode kernel: the Triton one (``triton_decode``) streams an fp8 cache at only 2.8-2.9 TB/s
against bf16's 3.5-3.6 (docs/BENCHMARKS.md §13-§31). It loads each tile straight into registers, converts it
there, and has one tile in flight per program while it computes; the converted fp8 tiles fill the register
file, so neither more stages nor more warps helped. Here the copy engine (TMA) keeps ``stages`` tiles of
raw fp8 bytes in flight per CTA in shared memory, whatever the registers hold.

One CTA of one warpgroup per (KV head, sequence), KV head fastest (the heads of a sequence read the same
pages side by side). For each tile of BKV tokens (``MosaicDecodeConfig.block_kv``: 128, or 64), with
R = q_per_seq x Gp query rows (16 or 32):
- S^T [BKV, R] = K [BKV, D] · q^T: K is the wgmma A operand in registers, loaded from the fp8 ring in the
  layout that converts to float16 with one instruction per pair and one warp shuffle; q^T comes from
  shared memory (float16, loaded once). The tile's tokens are the MMA's M rows, so nothing is padded to 64.
- the online softmax runs down S^T's columns (a cross-warp max per tile; the sums are reduced once, at the end);
- O^T [D, R] += V^T [D, BKV] · P^T [BKV, R]: V is converted to float16 into shared memory and read
  transposed by the wgmma (16-bit operands may be M-major), P^T is stored beside it.
The output leaves as O^T per (sequence, KV head); the wrapper transposes it and picks each token's rows.

Positions past a sequence's end get no probability, and V rows there are zeroed before P·V, so stale NaNs
in a reused page cannot leak (K needs nothing: masked logits are replaced).

jax's Mosaic GPU API is young: everything is imported lazily and ``unsupported_reason`` says when the
caller must use the Triton kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels import fp8, mosaic_common

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    stages: int = 2  # tiles of K and V in flight per CTA (shared-memory ring slots)
    block_kv: int = 128  # tokens per tile: the wgmma M of S^T = K q^T (a multiple of 64)


def smem_bytes(head_dim: int, rows: int, stages: int, block_kv: int = 64) -> int:
    """Shared memory of one CTA: the fp8 K and V rings, V and P^T in float16, q, barriers."""
    bkv = block_kv
    return 2 * stages * bkv * head_dim + (bkv * head_dim + bkv * rows + rows * head_dim) * 2 + 1024


def unsupported_reason(
    *, head_dim: int, q_dtype, kv_dtype, page_size: int, rows: int, sliding_window, interpret: bool,
    config: MosaicDecodeConfig = MosaicDecodeConfig(),
) -> str | None:
    """Why this kernel cannot serve a decode call (the caller then uses the Triton kernel), or None."""
    if not fp8.is_fp8(kv_dtype):
        return f"cache dtype {jnp.dtype(kv_dtype).name} (this kernel reads fp8 caches)"
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"query dtype {jnp.dtype(q_dtype).name} (float16 products; bf16 or f16 queries)"
    if sliding_window is not None:
        return "sliding window"
    if head_dim != 128:
        return f"head_dim {head_dim} (built and tested for 128)"
    if rows not in (16, 32):
        return f"{rows} query rows per KV head (the wgmma N of this kernel: 16 or 32)"
    if config.block_kv % 64:
        return f"block_kv {config.block_kv} (needs a multiple of 64)"
    if page_size % 8 or config.block_kv % page_size:
        return f"page size {page_size} (needs a multiple of 8 dividing {config.block_kv})"
    if smem_bytes(head_dim, rows, config.stages, config.block_kv) > mosaic_common.SMEM_BYTES:
        return f"{config.stages} stages of {config.block_kv} tokens (over the shared memory)"
    needs = ("kernel", "wgmma", "copy_gmem_to_smem", "Barrier", "Layout.WGMMA_UPCAST_2X")
    return mosaic_common.runtime_reason(interpret, needs)


def _kernel(
    info_ref,  # [S, 4] int32: (q_len, seq_len, tiles, 0); tiles = 0 for sequences this kernel leaves alone
    tables_ref,  # [S, Bp] int32
    q_ref,  # [S, K, R, D] float16: each (sequence, KV head)'s query rows
    k_ref,  # [N * P, K, D] fp8: the pages as one run of token rows
    v_ref,  # [N * P, K, D] fp8
    o_ref,  # out [S, K, D, R]: O^T
    q_smem,  # [R, D] f16, swizzled
    k_ring,  # [stages, BKV, D] fp8, swizzled
    v_ring,  # [stages, BKV, D] fp8, swizzled
    v16,  # [BKV, D] f16, swizzled: the converted V tile
    p16,  # [BKV, R] f16, swizzled: P^T
    q_bar,  # 1 barrier: q landed
    k_full,  # stages barriers, one arrival per page copy of a tile
    v_full,
    *,
    scale: float,
    gp: int,
    stages: int,
    block_kv: int,
    page_size: int,
    interpret: bool,
):
    plgpu = mosaic_common.plgpu()
    BKV = block_kv  # noqa: N806 (a constant of this kernel)
    kh, s = lax.axis_index("k"), lax.axis_index("s")
    rows, head_dim = q_smem.shape
    q_len, seq_len, n_tiles = info_ref[s, 0], info_ref[s, 1], info_ref[s, 2]
    pages_per_tile = BKV // page_size
    wgmma_layout = plgpu.Layout.WGMMA
    cast, iota = mosaic_common.wgmma_layout_helpers(interpret)

    def page_ids(t):  # read well before use: a global load's latency then hides behind the tile's work
        return [tables_ref[s, t * pages_per_tile + j] for j in range(pages_per_tile)]

    def issue(t, pages):  # tile t's pages into ring slot t % stages, one TMA copy per page for K and for V
        slot = lax.rem(t, jnp.int32(stages))
        for j, page in enumerate(pages):
            for src, ring, bar in ((k_ref, k_ring, k_full), (v_ref, v_ring, v_full)):
                dst = ring.at[slot].at[pl.ds(j * page_size, page_size)]
                plgpu.copy_gmem_to_smem(src.at[pl.ds(page * page_size, page_size), kh, :], dst, bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[s, kh], q_smem, q_bar)
    for t0 in range(stages):
        pl.when(t0 < n_tiles)(functools.partial(issue, jnp.int32(t0), page_ids(t0)))
    plgpu.barrier_wait(q_bar)

    # Each row's token position: rows past the sequence's new tokens are clamped to its last one (their
    # output is never read, and they must not see past the end).
    q_pos = jnp.minimum(seq_len - q_len + iota((BKV, rows), 1) // gp, seq_len - 1)  # [BKV, R]

    def load_tile(ring, slot):  # fp8 [BKV, D] in shared memory -> float16 registers in the wgmma layout
        if interpret:
            return ring[slot].astype(jnp.float16)
        raw = mosaic_common.load(ring.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_2X)
        return plgpu.layout_cast(raw.astype(jnp.float16), wgmma_layout)

    def body(t, carry, masked: bool):
        # acc O^T [D, R] f32; m [R]; l [BKV, R]: each thread's share of the row sums, reduced once at the end
        # (a cross-warp reduction per tile saved).
        acc, m, l, pages = carry
        slot = lax.rem(t, jnp.int32(stages))

        # Refill the slot the previous tile released (its reads ended at its commit_smem) before waiting for
        # this tile: the copies' issue then overlaps the wait instead of the products. Their page ids were
        # read one tile ahead, so the table's latency hides too (the table is padded to cover them).
        @pl.when((t > 0) & (t - 1 + stages < n_tiles))
        def _():
            issue(t - 1 + stages, pages)

        pages = page_ids(t + stages)

        plgpu.barrier_wait(k_full.at[slot])
        k = load_tile(k_ring, slot)
        if interpret:
            logits = jnp.dot(k, q_smem[...].T, preferred_element_type=jnp.float32)
        else:

            def qk(acc_ref):
                # ref.transpose, not plgpu.transpose_ref (deprecated in jax 0.11; it only called this)
                plgpu.wgmma(acc_ref, k, q_smem.transpose((1, 0)))
                return acc_ref[...]

            logits = pl.run_scoped(qk, plgpu.ACC((BKV, rows), jnp.float32))  # [BKV, R]
        logits = logits * (scale * _LOG2E)  # base-2 units
        if masked:
            logits = jnp.where(t * BKV + iota((BKV, rows), 0) <= q_pos, logits, -jnp.inf)
        m_next = jnp.maximum(m, logits.max(axis=0))
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(logits - lax.broadcast_in_dim(m_next, logits.shape, [1]))
        l = l * lax.broadcast_in_dim(alpha, l.shape, [1]) + p
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

        plgpu.barrier_wait(v_full.at[slot])
        v = load_tile(v_ring, slot)
        if masked:
            v = jnp.where(t * BKV + iota((BKV, head_dim), 0) < seq_len, v, jnp.zeros_like(v))
        v16[...] = v
        p16[...] = p.astype(jnp.float16)
        plgpu.commit_smem()  # every thread is done with the slot, and v16 / p16 are visible to the wgmma
        if interpret:
            acc = acc + jnp.dot(v16[...].T, p16[...], preferred_element_type=jnp.float32)
        else:

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, v16.transpose((1, 0)), p16)

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        return acc, m_next, l, pages

    acc = cast(jnp.zeros((head_dim, rows), jnp.float32), wgmma_layout)
    m = cast(jnp.full((rows,), -jnp.inf, jnp.float32), wgmma_layout.reduce(0))
    l = cast(jnp.zeros((BKV, rows), jnp.float32), wgmma_layout)
    # Tiles that every row sees whole hold no position past the sequence's end: no masks there.
    n_full = jnp.minimum(jnp.maximum(seq_len - q_len + 1, 0) // BKV, n_tiles)
    carry = (acc, m, l, page_ids(jnp.int32(stages - 1)))  # a placeholder: tile 0 refills nothing
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m, l, _ = lax.fori_loop(n_full, n_tiles, functools.partial(body, masked=True), carry)
    l = l.sum(axis=0)

    @pl.when(n_tiles > 0)
    def _():
        out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [1])
        # Straight from registers to global memory: a staging buffer would cost shared memory, and with it
        # a CTA per SM (the kernel is bound by how many CTAs keep tiles in flight). A row of O^T is 16 or 32
        # bytes, less than the whole 32-byte sectors per transfer that jax 0.12 plans for: hence unplanned.
        mosaic_common.store_unplanned(o_ref.at[s, kh], out.astype(o_ref.dtype), interpret)


def decode_attention_mosaic(
    q_p: jax.Array,  # [T (+ pad), K, Gp, D]
    k_pages: jax.Array,  # [N, P, K, D] fp8
    v_pages: jax.Array,  # [N, P, K, D] fp8
    query_start_loc: jax.Array,  # [S+1]
    seq_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, B]
    token_seq_ids: jax.Array,  # [T]
    *,
    scale: float,
    q_per_seq: int,
    config: MosaicDecodeConfig = MosaicDecodeConfig(),
    interpret: bool = False,
) -> jax.Array:  # [T, K, Gp, D]: rows of tokens of sequences with <= q_per_seq new tokens; others undefined
    """Attention of the decode tokens (sequences with at most ``q_per_seq`` new tokens) over an fp8 cache."""
    plgpu = mosaic_common.plgpu()
    t = token_seq_ids.shape[0]
    _, kh, gp, d = q_p.shape
    _, page_size, _, _ = k_pages.shape
    s_count, width = block_tables.shape
    rows = q_per_seq * gp
    BKV, stages = config.block_kv, config.stages  # noqa: N806
    qsl = query_start_loc
    q_lens = qsl[1:] - qsl[:-1]
    active = (q_lens > 0) & (q_lens <= q_per_seq)
    n_tiles = jnp.where(active, pl.cdiv(seq_lens, BKV), 0)
    info = jnp.stack([q_lens, seq_lens, n_tiles, jnp.zeros_like(q_lens)], axis=1).astype(jnp.int32)  # [S, 4]
    # Padded so that every tile's page ids exist, and those of the tiles read ahead past the last one.
    padded_width = pl.cdiv(pl.cdiv(width * page_size, BKV) * BKV, page_size) + stages * (BKV // page_size)
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_width - width)))
    # Each sequence's query rows (token-major, then head), float16: [S, K, R, D]. Rows past a sequence's
    # tokens hold other tokens' queries; their outputs are dropped below.
    tok = jnp.clip(qsl[:-1, None] + jnp.arange(q_per_seq)[None, :], 0, q_p.shape[0] - 1)  # [S, QA]
    q_items = q_p[tok].astype(jnp.float16)  # [S, QA, K, Gp, D]
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(s_count, kh, rows, d)

    swizzle = lambda dt: (plgpu.TilingTransform((8, 128 // jnp.dtype(dt).itemsize)), plgpu.SwizzleTransform(128))
    p_swizzle = (plgpu.TilingTransform((8, rows)), plgpu.SwizzleTransform(rows * 2))
    kernel = functools.partial(
        _kernel, scale=scale, gp=gp, stages=stages, block_kv=BKV, page_size=page_size, interpret=interpret
    )
    kv = k_pages.dtype
    o_t = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((s_count, kh, d, rows), q_p.dtype),
        scratch_types=[
            plgpu.SMEM((rows, d), jnp.float16, transforms=swizzle(jnp.float16)),
            plgpu.SMEM((stages, BKV, d), kv, transforms=swizzle(kv)),
            plgpu.SMEM((stages, BKV, d), kv, transforms=swizzle(kv)),
            plgpu.SMEM((BKV, d), jnp.float16, transforms=p_swizzle),  # the wgmma wants its operands' swizzles equal
            plgpu.SMEM((BKV, rows), jnp.float16, transforms=p_swizzle),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=BKV // page_size, num_barriers=stages),
            plgpu.Barrier(num_arrivals=BKV // page_size, num_barriers=stages),
        ],
        grid=(kh, s_count),
        grid_names=("k", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=mosaic_common.interpret_params() if interpret else None,
    )(info, tables, q_items, k_pages.reshape(-1, kh, d), v_pages.reshape(-1, kh, d))
    # [S, K, D, R] -> [S, K, QA, Gp, D], then each token's rows from its sequence.
    o = o_t.transpose(0, 1, 3, 2).reshape(s_count, kh, q_per_seq, gp, d)
    seq = token_seq_ids
    r = jnp.clip(jnp.arange(t, dtype=jnp.int32) - qsl[seq], 0, q_per_seq - 1)
    return o[seq, :, r]  # [T, K, Gp, D]

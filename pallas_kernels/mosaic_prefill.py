"""Prefill/extend-path kernel for Hopper (Pallas, Mosaic GPU lowering): causal flash attention over the
paged cache on the tensor cores' warpgroup MMA (wgmma), fed by the bulk tensor copy engine (TMA).

Work items are (query block, query head) pairs; a query block is ``2 * BQ`` consecutive new tokens of
one sequence (``query_block_schedule``). The wrapper turns the blocks into a table of the scalars the
kernel needs (``block_info``). The grid is persistent, one CTA per SM, each CTA walking items
``cta, cta + num_ctas, ...`` longest block first, heads of one block side by side (the G heads that share a
KV head read its pages while they are in L2). A step with no prefill work (pure decode) costs one wave of
CTAs that find nothing to do. Each CTA runs three warpgroups:
- warpgroups 0 and 1 each own BQ = 64 query rows (the wgmma M tile): S = Q K^T and O += P V on wgmma,
  the online softmax in registers;
- warpgroup 2 only issues copies (``mosaic_kv_producer``): each item's Q rows into one of two Q buffers,
  and for KV tile t the tile's pages (one TMA copy of [P, D] per page, straight from the block table) into
  ring slot t % stages, once both compute warpgroups have released that slot. The ring runs on across
  items, and the producer runs ahead of the compute warpgroups, so an item's Q and its scalars (read one
  item ahead) are there when its compute starts: no copy latency between items.
``MosaicPrefillConfig.pingpong`` adds FlashAttention-3's turn barrier between the compute warpgroups (one's
softmax under the other's wgmma); on the H200 it measured 4% slower than without (2026-11-29), so it is off.
The KV loop of each compute warpgroup ends at its last row's position (causal); tiles before its first
row skip the mask. Output rows are stored with a short ladder of TMA stores (64, 32, ..., 1 rows) so that
exactly the block's real tokens are written: the next rows belong to another sequence. The padding
tokens past ``query_start_loc[-1]`` are one more pseudo-sequence with no context, stored as zeros, so the
engine's output needs no separate masking pass; decode tokens' rows are left to the decode kernel.

Values in cache slots past a sequence's end (a reused page's leftovers, or pages a tile reads past the
table's end) get a zero probability; V rows there are zeroed in shared memory before the P V product, so
a stale NaN cannot turn 0 * NaN into NaN (K needs nothing: masked logits are replaced).

Written in Mosaic GPU's lane-level semantics (explicit register layouts), which jax 0.10 and 0.11 both
lower. jax's Mosaic GPU API is young and changes between releases: everything here is imported lazily,
and ``unsupported_reason`` says when the caller must use the Triton kernel instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels import mosaic_common, mosaic_kv_producer
from jaxserve.pallas_kernels.triton_prefill import query_block_schedule

BQ = 64  # query rows per compute warpgroup: the wgmma M tile
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class MosaicPrefillConfig:
    block_kv: int = 128  # KV tokens per pipeline step (a multiple of 64)
    stages: int = 2  # KV ring slots in shared memory
    # Ping-pong: a barrier makes the two compute warpgroups take turns on the tensor cores, so that one
    # runs its softmax while the other's wgmma runs (FlashAttention-3's schedule).
    pingpong: bool = False
    # Q as the wgmma A operand from (swizzled) shared memory instead of registers: 32 registers fewer.
    q_smem: bool = False




def smem_bytes(head_dim: int, block_kv: int, stages: int, itemsize: int = 2, q_smem: bool = False) -> int:
    """Shared memory of one CTA: the K and V rings, two plain Q/O buffers of both compute warpgroups (and
    a swizzled Q buffer with ``q_smem``), a little for the barriers."""
    return (2 * stages * block_kv + 2 * BQ * (2 + q_smem)) * head_dim * itemsize + 1024


def unsupported_reason(
    *, head_dim: int, dtype, page_size: int, block_kv: int, sliding_window: int | None, interpret: bool,
    stages: int = 2, q_smem: bool = False,
) -> str | None:
    """Why this kernel cannot serve a call (the caller then uses the Triton kernel), or None."""
    if sliding_window is not None:
        return "sliding window"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (wgmma path takes bf16/f16)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (built and tested for 64 and 128)"
    if block_kv % 64:
        return f"block_kv {block_kv} (needs a multiple of 64)"
    if smem_bytes(head_dim, block_kv, stages, q_smem=q_smem) > mosaic_common.SMEM_BYTES:
        return f"block_kv {block_kv} x {stages} stages at head_dim {head_dim} (over the shared memory)"
    whole_pages = page_size <= block_kv and block_kv % page_size == 0
    page_slices = page_size > block_kv and page_size % block_kv == 0
    if page_size % 8 or not (whole_pages or page_slices):
        return f"page size {page_size} with block_kv {block_kv}"
    needs = ("kernel", "wgmma", "copy_gmem_to_smem", "Barrier", "LoweringSemantics.Lane")
    return mosaic_common.runtime_reason(interpret, needs)


def block_info(sched, qsl, lens, *, block_kv: int) -> jax.Array:
    """[NB, 8] int32 per query block: (sequence, first token, seq_len, real tokens, first position, KV
    tiles, 0, 0). One table row gives the kernel every scalar of an item in one round of loads (the
    schedule alone needs two dependent rounds: block -> sequence -> its offsets)."""
    s, q_off = sched[:, 0], sched[:, 1]
    q_start = qsl[s]
    q_len = qsl[s + 1] - q_start
    seq_len = lens[s]
    n_valid = jnp.clip(q_len - q_off, 0, 2 * BQ)  # real tokens in the block
    pos0 = seq_len - q_len + q_off  # position of the block's first token
    # KV tiles up to the block's last causal position (none for the padding pseudo-sequence).
    n_steps = jnp.maximum(pl.cdiv(jnp.minimum(seq_len, pos0 + n_valid), block_kv), 0)
    zero = jnp.zeros_like(s)
    return jnp.stack([s, q_start + q_off, seq_len, n_valid, pos0, n_steps, zero, zero], axis=1)


def _kernel(
    info_ref,  # [NB, 8] int32: ``block_info``, used blocks first
    n_blocks_ref,  # [1] int32: how many blocks are used
    tables_ref,  # [S+1, Bp] int32
    q_ref,  # [T, H, D]
    k_ref,  # [N * P, K, D]: the pages as one run of token rows
    v_ref,  # [N * P, K, D]
    o_ref,  # out [T, H, D]
    qo_smem,  # [2, 2, BQ, D] plain rows, (item parity, warpgroup): Q's TMA copy from any token, later O
    qw_smem,  # [2, BQ, D] swizzled: Q as the wgmma A operand (config.q_smem)
    k_smem,  # [stages, BKV, D]
    v_smem,  # [stages, BKV, D]
    q_full,  # 4 barriers (item parity * 2 + warpgroup): the Q copy landed
    q_free,  # 4 barriers: the warpgroup has Q in registers and its O store has read the buffer
    k_full,  # stages barriers, one arrival per page copy of a tile
    v_full,
    k_free,  # stages barriers, one arrival per compute warpgroup
    v_free,
    turn,  # 1 barrier, one arrival per compute warpgroup: the ping-pong turns
    *,
    scale: float,
    num_heads: int,
    group: int,
    block_kv: int,
    stages: int,
    num_ctas: int,
    pingpong: bool,
    q_smem: bool,
    page_size: int,
    interpret: bool,
):
    plgpu = mosaic_common.plgpu()
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype
    wg = lax.axis_index("wg")
    n_blocks = n_blocks_ref[0]
    n_items = n_blocks * num_heads  # work items: (query block, query head), heads of a block adjacent

    def item_info(i):
        """Scalars of work item i; blocks run longest first (the schedule lists each sequence's blocks in
        order, so later blocks, with more causal work, come last). Sorting them all by length measured no
        better for equal prompts and costs a sort per step. An index past the last item (prefetches make
        them) reads a real row."""
        blk = jnp.maximum(n_blocks - 1 - lax.div(i, jnp.int32(num_heads)), 0)
        names = ("s", "tok0", "seq_len", "n_valid", "pos0", "n_steps")
        return dict(h=lax.rem(i, jnp.int32(num_heads)), **{k: info_ref[blk, c] for c, k in enumerate(names)})

    # Each CTA takes items cta, cta + num_ctas, ...: n_local of them. The KV ring runs on across items, so
    # every warpgroup counts global steps (`g0`: the first step of the item) to keep slots and barrier
    # phases in step; Q buffers alternate by the item's parity.
    cta = lax.axis_index("c")
    n_local = jnp.maximum(pl.cdiv(n_items - cta, num_ctas), 0)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _compute():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        wgmma_layout = plgpu.Layout.WGMMA
        cast, iota = mosaic_common.wgmma_layout_helpers(interpret)

        # Ping-pong: every KV step of a warpgroup passes the turn barrier twice (after issuing Q K^T, and
        # between softmax and P V), released tiles included. Warpgroup 1 falls one turn behind at the CTA's
        # first KV step, so each warpgroup's tensor-core work falls in the other's softmax; warpgroup 0 evens
        # the count at the end. Not at the start: warpgroup 1 would then wait for warpgroup 0's first tile
        # while still holding a Q buffer, which the producer may need back to copy that tile's item (items
        # with no KV steps, like the padding tokens', can come first).
        def fall_behind(g):
            if pingpong:
                pl.when((wg == 1) & (g == 0))(take_turn)

        def _item(n, carry):
            g0, it = carry
            nxt = item_info(cta + (n + 1) * num_ctas)  # next item's scalars: their loads hide behind this one
            h, seq_len, n_steps = it["h"], it["seq_len"], it["n_steps"]
            rows = jnp.clip(it["n_valid"] - wg * BQ, 0, BQ)  # real rows of this warpgroup
            wpos0 = it["pos0"] + wg * BQ
            steps = jnp.where(rows > 0, jnp.maximum(pl.cdiv(jnp.minimum(seq_len, wpos0 + rows), block_kv), 0), 0)
            full = jnp.clip((wpos0 + 1) // block_kv, 0, steps)  # tiles every row sees whole: no mask
            # The tile holding the sequence's end, when that end is not tile-aligned: V rows past it are zeroed.
            ragged_tile = jnp.where(seq_len % block_kv != 0, seq_len // block_kv, -1)
            qb = lax.rem(n, 2) * 2 + wg  # this item's Q/O buffer and barriers
            qs = qo_smem.at[lax.rem(n, 2), wg]
            row0 = it["tok0"] + wg * BQ  # flat token of this warpgroup's first row

            plgpu.barrier_wait(q_full.at[qb])  # the producer copied Q rows ahead of time
            q_regs = qs[...] if interpret else mosaic_common.load(qs, layout=wgmma_layout, optimized=False)

            @pl.when(n > 0)
            def _():  # hand the previous item's buffer back once its O store has read it
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(q_free.at[lax.rem(n + 1, 2) * 2 + wg])

            if q_smem:  # registers -> swizzled shared memory, the A operand of every Q K^T of the item
                q_op = qw_smem.at[wg]
                q_op[...] = q_regs
                plgpu.commit_smem()
            else:
                q_op = q_regs

            acc = cast(jnp.zeros((BQ, head_dim), jnp.float32), wgmma_layout)
            m = cast(jnp.full((BQ,), -jnp.inf, jnp.float32), wgmma_layout.reduce(1))
            l = cast(jnp.zeros((BQ,), jnp.float32), wgmma_layout.reduce(1))

            def step(t, carry, masked: bool):
                acc, m, l = carry
                fall_behind(g0 + t)
                slot = lax.rem(g0 + t, jnp.int32(stages))
                plgpu.barrier_wait(k_full.at[slot])
                kt = k_smem.at[slot]
                if interpret:  # the interpreter's wgmma takes no transposed operand
                    logits = jnp.dot(q_op[...] if q_smem else q_op, kt[...].T, preferred_element_type=jnp.float32)
                    if pingpong:
                        take_turn()
                else:

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_op, kt.transpose((1, 0)))
                        if pingpong:
                            take_turn()  # the other warpgroup's P V is issued: its softmax now overlaps ours
                        return acc_ref[...]

                    logits = pl.run_scoped(qk, plgpu.ACC((BQ, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    r, c = iota((BQ, block_kv), 0), iota((BQ, block_kv), 1)
                    logits = jnp.where(wpos0 + r >= t * block_kv + c, logits, -jnp.inf)
                # m is kept in base-2 units (scale * log2 e applied): the exponent is one FMA per logit.
                m_next = jnp.maximum(m, logits.max(axis=1) * (scale * _LOG2E))
                alpha = jnp.exp2(m - m_next)
                p = jnp.exp2(logits * (scale * _LOG2E) - lax.broadcast_in_dim(m_next, logits.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if pingpong:
                    if not interpret:  # finish the softmax before handing over the tensor cores
                        acc, l, m_next, p16 = lax.optimization_barrier((acc, l, m_next, p16))
                    plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_full.at[slot])
                if pingpong:
                    plgpu.barrier_wait(turn)
                vt = v_smem.at[slot]
                if masked:

                    @pl.when(t == ragged_tile)
                    def _():
                        # Both compute warpgroups may do this on the same slot: they write identical zeros.
                        kv_row = iota((block_kv, head_dim), 0)
                        vt[...] = jnp.where(t * block_kv + kv_row < seq_len, vt[...], 0).astype(vt.dtype)
                        plgpu.commit_smem()

                if interpret:
                    acc = acc + jnp.dot(p16, vt[...], preferred_element_type=jnp.float32)
                else:

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, vt)

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_next, l

            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
            acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)

            # Release the tiles this warpgroup does not need (the other one's rows reach further). Waiting
            # for each load first keeps one arrival per phase: the copy into a slot waits for both releases.
            @pl.loop(steps, n_steps)
            def _(t):
                fall_behind(g0 + t)
                slot = lax.rem(g0 + t, jnp.int32(stages))
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                if pingpong:
                    take_turn()
                    take_turn()

            @pl.when(rows > 0)
            def _():
                # l == 0 only for padding tokens (no context): they come out as zeros.
                out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
                # qs is unswizzled (the TMA store reads it row by row), so this store has bank conflicts
                # that jax 0.12 only accepts unplanned; it is once per item.
                mosaic_common.store_unplanned(qs, out.astype(dtype), interpret)
                plgpu.commit_smem()
                # Store exactly `rows` rows: one TMA copy per set bit of `rows`, largest first. Nobody waits
                # for them here: the buffer goes back to the producer at the next item's start.
                start = 0
                size = BQ
                while size >= 1:

                    @pl.when((rows & size) != 0)
                    def _(start=start, size=size):
                        plgpu.copy_smem_to_gmem(qs.at[pl.ds(start, size)], o_ref.at[pl.ds(row0 + start, size), h])

                    start = start + (rows & size)
                    size //= 2

            return g0 + n_steps, nxt

        g_end, _ = lax.fori_loop(0, n_local, _item, (jnp.int32(0), item_info(cta)))

        if pingpong:
            pl.when((wg == 0) & (g_end > 0))(take_turn)
        plgpu.wait_smem_to_gmem(0)  # every output row written before the CTA ends

        @pl.when(n_local > 0)
        def _():  # the last item's buffer: every phase of q_free is observed by the producer
            plgpu.barrier_arrive(q_free.at[lax.rem(n_local - 1, 2) * 2 + wg])

    @pl.when(wg == 2)
    def _memory():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        mosaic_kv_producer.produce(
            item_info, n_local, cta, num_ctas, tables_ref, (q_ref, qo_smem, q_full, q_free),
            (k_ref, v_ref), (k_smem, v_smem), (k_full, v_full), (k_free, v_free),
            group=group, block_q=BQ, block_kv=block_kv, page_size=page_size, stages=stages,
        )  # fmt: skip


def _num_sms(interpret: bool) -> int:
    if interpret:
        return 2  # a few CTAs, each with several items: exercises the persistent loop, runs fast
    return int(getattr(jax.devices()[0], "core_count", None) or 132)


def prefill_attention_mosaic(
    q: jax.Array,  # [T, H, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    query_start_loc: jax.Array,  # [S+1]
    seq_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, B]
    is_prefill_seq: jax.Array,  # [S] bool
    *,
    scale: float,
    max_prefill_seqs: int | None = None,
    config: MosaicPrefillConfig = MosaicPrefillConfig(),
    interpret: bool = False,
) -> jax.Array:  # [T, H, D]: rows of prefill tokens, zeros for padding tokens, the rest unwritten
    """Causal attention of the prefill sequences' tokens; padding tokens (past query_start_loc[-1]) get zeros."""
    plgpu = mosaic_common.plgpu()
    t, h, d = q.shape
    _, page_size, kh, _ = k_pages.shape
    s_count, width = block_tables.shape
    bkv, stages = config.block_kv, config.stages
    block_q = 2 * BQ
    n_pf = s_count if max_prefill_seqs is None else min(s_count, max_prefill_seqs)
    # The padding tokens [query_start_loc[-1], T) form one more "sequence" with no context: zeros.
    qsl = jnp.concatenate([query_start_loc, jnp.full((1,), t, query_start_loc.dtype)])  # [S+2]
    lens = jnp.concatenate([seq_lens, jnp.zeros((1,), seq_lens.dtype)])  # [S+1]
    mine = jnp.concatenate([is_prefill_seq, jnp.ones((1,), bool)])  # [S+1]
    num_blocks = pl.cdiv(t, block_q) + n_pf + 1
    blk_seq, blk_off = query_block_schedule(qsl, mine, block_q=block_q, num_blocks=num_blocks)
    q_lens = qsl[1:] - qsl[:-1]
    n_used = jnp.sum(jnp.where(mine, pl.cdiv(q_lens, block_q), 0)).astype(jnp.int32).reshape(1)
    info = block_info(jnp.stack([blk_seq, blk_off], axis=1), qsl, lens, block_kv=bkv)  # [NB, 8]
    # Pad the table so that every tile's page ids exist; pages past seq_len are read and then masked.
    padded_width = max(width, pl.cdiv(pl.cdiv(width * page_size, bkv) * bkv, page_size))
    tables = jnp.pad(block_tables, ((0, 1), (0, padded_width - width)))  # [S+1, Bp]

    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    copies_per_tile = max(1, bkv // page_size)
    num_ctas = _num_sms(interpret)
    kernel = functools.partial(
        _kernel,
        scale=scale,
        num_heads=h,
        group=h // kh,
        block_kv=bkv,
        stages=stages,
        num_ctas=num_ctas,
        pingpong=config.pingpong,
        q_smem=config.q_smem,
        page_size=page_size,
        interpret=interpret,
    )
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((t, h, d), q.dtype),
        scratch_types=[
            plgpu.SMEM((2, 2, BQ, d), q.dtype),
            plgpu.SMEM((2, BQ, d), q.dtype, transforms=swizzled) if config.q_smem else None,
            plgpu.SMEM((stages, bkv, d), q.dtype, transforms=swizzled),
            plgpu.SMEM((stages, bkv, d), q.dtype, transforms=swizzled),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=stages),
            plgpu.Barrier(num_arrivals=copies_per_tile, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(num_ctas,),
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=mosaic_common.interpret_params() if interpret else None,
    )(info, n_used, tables, q, k_pages.reshape(-1, kh, d), v_pages.reshape(-1, kh, d))

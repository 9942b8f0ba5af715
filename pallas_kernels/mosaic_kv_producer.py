"""The copy warpgroup of the Mosaic GPU prefill kernel (``mosaic_prefill``): for each work item it copies the
item's Q rows into one of two Q buffers (alternating by item), then gathers each KV tile's pages from the
paged cache into a shared-memory ring slot with TMA copies, one per page (16 rows at block size 16), once
both compute warpgroups have released that slot. The ring runs on across a CTA's work items; running ahead
of the compute warpgroups, the producer has the next item's Q in place before they finish the current one.

Every copy starts at a multiple of 8 rows, in its page and in the tiled ring slot (whole pages of a multiple
of 8 rows, or page slices at multiples of block_kv): a tiled TMA copy starting elsewhere came back wrong on
the H200. K and V of a tile share page ids: they are read once, before the wait for a free slot, so that
their latency hides behind it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def produce(
    item_info,  # i -> dict of the work item's scalars (s, h, tok0, n_valid, n_steps)
    n_local,  # scalar: this CTA's items, cta, cta + num_ctas, ...
    cta,  # scalar: this CTA
    num_ctas: int,
    tables_ref,  # [S+1, Bp] int32
    q_parts,  # (q [T, H, D], Q buffers [2, 2, BQ, D], full and free barriers [4] each: parity * 2 + warpgroup)
    pages,  # (K, V), each [N * P, KH, D]: the pages as one run of token rows
    rings,  # (K, V) ring buffers, each [stages, block_kv, D] in shared memory
    full,  # (K, V) barriers: a slot's copies landed
    free,  # (K, V) barriers: both compute warpgroups released a slot
    *,
    group: int,  # query heads per KV head
    block_q: int,  # query rows per compute warpgroup
    block_kv: int,
    page_size: int,
    stages: int,
):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q_ref, q_bufs, q_full, q_free = q_parts

    def tile_pages(s, t):  # [(page id, first row in the slot, first row in the page, rows)]
        if page_size <= block_kv:  # several whole pages per tile
            per = block_kv // page_size
            return [(tables_ref[s, t * per + j], j * page_size, 0, page_size) for j in range(per)]
        per_page = page_size // block_kv  # a slice of one page
        off = lax.rem(t, jnp.int32(per_page)) * block_kv
        return [(tables_ref[s, t // per_page], 0, off, block_kv)]

    def copy_q(n, it):
        """Both compute warpgroups' Q rows of local item n, into the buffers of n's parity once the item
        two back has released them. A warpgroup with no real rows gets a copy too (one arrival per phase)."""
        par = lax.rem(n, 2)
        for w in range(2):

            @pl.when(n >= 2)
            def _():
                plgpu.barrier_wait(q_free.at[par * 2 + w])

            # A start past the last token would put the whole box out of bounds: such rows are never used.
            row = jnp.where(it["n_valid"] > w * block_q, it["tok0"] + w * block_q, it["tok0"])
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row, block_q), it["h"]], q_bufs.at[par, w], q_full.at[par * 2 + w])

    def item(n, g0):
        it = item_info(cta + n * num_ctas)
        s, kvh = it["s"], lax.div(it["h"], jnp.int32(group))
        copy_q(n, it)

        @pl.loop(0, it["n_steps"])
        def _(t):
            g = g0 + t
            slot = lax.rem(g, jnp.int32(stages))
            tile = tile_pages(s, t)
            for src_ref, ring, full_bar, free_bar in zip(pages, rings, full, free):

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(free_bar.at[slot])

                for page, dst_row, src_row, n_rows in tile:
                    src = src_ref.at[pl.ds(page * page_size + src_row, n_rows), kvh, :]
                    plgpu.copy_gmem_to_smem(src, ring.at[slot].at[pl.ds(dst_row, n_rows)], full_bar.at[slot])

        return g0 + it["n_steps"]

    g_end = lax.fori_loop(0, n_local, item, jnp.int32(0))

    # Wait for the last releases too, so that every phase of the free barriers is observed before the
    # program ends (the hardware would not mind; the interpreter checks it).
    @pl.loop(jnp.maximum(g_end - stages, 0), g_end)
    def _(g):
        slot = lax.rem(g, jnp.int32(stages))
        for free_bar in free:
            plgpu.barrier_wait(free_bar.at[slot])

    @pl.loop(jnp.maximum(n_local - 2, 0), n_local)
    def _(n):
        for w in range(2):
            plgpu.barrier_wait(q_free.at[lax.rem(n, 2) * 2 + w])

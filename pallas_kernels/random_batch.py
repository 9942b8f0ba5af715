"""Random ragged batches over a paged cache, built the way the model runner pads them (tests and benchmarks).

``make_batch`` draws shuffled block tables, fills every cache slot (stale ones too) with random values,
and pads tokens and sequences exactly as ``AttentionMetadata`` documents.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.metadata import AttentionMetadata


@dataclasses.dataclass
class RaggedBatch:
    q: jnp.ndarray  # [T, H, D]
    k_new: jnp.ndarray  # [T, K, D]
    v_new: jnp.ndarray  # [T, K, D]
    k_pages: jnp.ndarray  # [N, P, K, D]
    v_pages: jnp.ndarray  # [N, P, K, D]
    md: AttentionMetadata


def make_batch(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    ctx_lens: list[int],  # context length of each sequence including its new tokens
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=jnp.bfloat16,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    table_width: int | None = None,
    num_blocks: int | None = None,
    stale_value: float | None = None,  # fill slots no sequence owns with this (e.g. NaN) instead of noise
) -> RaggedBatch:
    assert len(q_lens) == len(ctx_lens) and all(1 <= q <= c for q, c in zip(q_lens, ctx_lens))
    n_real = len(q_lens)
    s_count = n_real + pad_seqs
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    width = table_width or max(blocks_per_seq)
    total_blocks = num_blocks or sum(blocks_per_seq) + 3
    perm = rng.permutation(total_blocks)  # shuffled physical pages
    tables = np.zeros((s_count, width), np.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[used : used + nb]
        # Unused table entries point at real (other sequences') pages: masking must ignore them.
        tables[s, nb:] = rng.integers(0, total_blocks, width - nb)
        used += nb

    t_real = sum(q_lens)
    t = t_real + pad_tokens
    qsl = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, t_real)]).astype(np.int32)
    seq_lens = np.array(list(ctx_lens) + [0] * pad_seqs, np.int32)
    positions, slots, seq_ids = [], [], []
    for s, (ql, cl) in enumerate(zip(q_lens, ctx_lens)):
        for pos in range(cl - ql, cl):
            positions.append(pos)
            slots.append(tables[s, pos // block_size] * block_size + pos % block_size)
            seq_ids.append(s)
    oob = total_blocks * block_size
    positions += [0] * pad_tokens
    slots += [oob] * pad_tokens
    seq_ids += [s_count - 1] * pad_tokens
    logits_idx = np.array(list(np.cumsum(q_lens) - 1) + [0] * pad_seqs, np.int32)

    shape = (total_blocks, block_size, num_kv_heads, head_dim)
    k_pages = rng.standard_normal(shape, np.float32)
    v_pages = rng.standard_normal(shape, np.float32)
    if stale_value is not None:
        owned = np.zeros(total_blocks * block_size, bool)
        for s, cl in enumerate(ctx_lens):
            pos = np.arange(cl)
            owned[tables[s, pos // block_size] * block_size + pos % block_size] = True
        k_pages.reshape(-1, num_kv_heads, head_dim)[~owned] = stale_value
        v_pages.reshape(-1, num_kv_heads, head_dim)[~owned] = stale_value

    md = AttentionMetadata(
        positions=jnp.asarray(positions, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq_ids=jnp.asarray(seq_ids, jnp.int32),
        query_start_loc=jnp.asarray(qsl),
        seq_lens=jnp.asarray(seq_lens),
        block_tables=jnp.asarray(tables),
        logits_indices=jnp.asarray(logits_idx),
    )
    return RaggedBatch(
        q=jnp.asarray(rng.standard_normal((t, num_heads, head_dim), np.float32), dtype),
        k_new=jnp.asarray(rng.standard_normal((t, num_kv_heads, head_dim), np.float32), dtype),
        v_new=jnp.asarray(rng.standard_normal((t, num_kv_heads, head_dim), np.float32), dtype),
        k_pages=jnp.asarray(k_pages, dtype),
        v_pages=jnp.asarray(v_pages, dtype),
        md=md,
    )

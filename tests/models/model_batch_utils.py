"""Test helpers: hand-built ragged batches over a paged KV cache, and a jitted forward like the runner's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.pallas_kernels.metadata import AttentionMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_BLOCKS = 8  # per sequence: 32 tokens
T_PAD = 32  # every step is padded to this many tokens, so each model compiles once
S_PAD = 2  # ... and to this many sequences


@dataclasses.dataclass
class Chunk:
    """One sequence's share of a step: tokens ``ids`` at positions ``start .. start + len(ids) - 1``."""

    ids: list[int]
    start: int
    table: list[int]  # the sequence's physical block ids


def block_tables(num_seqs: int, seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block lists, so a wrong block-table lookup cannot pass by luck."""
    perm = np.random.default_rng(seed).permutation(NUM_BLOCKS)
    return [perm[i * MAX_BLOCKS : (i + 1) * MAX_BLOCKS].tolist() for i in range(num_seqs)]


def make_batch(chunks: list[Chunk]) -> tuple[jax.Array, AttentionMetadata]:
    """(input_ids [T_PAD], metadata) for a ragged step, padded as the metadata contract describes."""
    ids, positions, slots, seq_ids, starts, seq_lens = [], [], [], [], [0], []
    tables = np.zeros((S_PAD, MAX_BLOCKS), np.int32)
    for s, c in enumerate(chunks):
        pos = list(range(c.start, c.start + len(c.ids)))
        ids += c.ids
        positions += pos
        slots += [c.table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
        seq_ids += [s] * len(pos)
        starts.append(starts[-1] + len(pos))
        seq_lens.append(c.start + len(c.ids))
        tables[s, : len(c.table)] = c.table
    n_real = len(ids)
    assert n_real <= T_PAD and len(chunks) <= S_PAD
    pad_t = T_PAD - n_real
    ids += [0] * pad_t
    positions += [0] * pad_t
    slots += [NUM_BLOCKS * BLOCK_SIZE] * pad_t  # out of range: the KV write is dropped
    seq_ids += [S_PAD - 1] * pad_t
    starts += [starts[-1]] * (S_PAD - len(chunks))
    seq_lens += [0] * (S_PAD - len(chunks))
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    md = AttentionMetadata(
        positions=i32(positions),
        slot_mapping=i32(slots),
        token_seq_ids=i32(seq_ids),
        query_start_loc=i32(starts),
        seq_lens=i32(seq_lens),
        block_tables=jnp.asarray(tables),
        logits_indices=i32(np.maximum(np.asarray(starts[1:]) - 1, 0)),
    )
    return i32(ids), md


def empty_caches(cfg, dtype=jnp.float32) -> list[tuple[jax.Array, jax.Array]]:
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_hidden_layers)]


class Runner:
    """A jitted pure step over (graphdef, state), the way the model runner drives the model."""

    def __init__(self, model: nnx.Module):
        self.graphdef, self.state = nnx.split(model)
        self.caches = empty_caches(model.config, jax.tree.leaves(self.state)[0].dtype)

        @jax.jit
        def step(state, caches, ids, md):
            m = nnx.merge(self.graphdef, state)
            hidden, caches = m(ids, caches, md)  # [T, D]
            return m.compute_logits(hidden), caches  # [T, V] float32

        self._step = step

    def run(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """Run one step; returns each chunk's logits [len(ids), V]."""
        ids, md = make_batch(chunks)
        logits, self.caches = self._step(self.state, self.caches, ids, md)
        logits = np.asarray(logits)
        starts = np.asarray(md.query_start_loc)
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]

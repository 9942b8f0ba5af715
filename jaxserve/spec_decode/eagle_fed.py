"""EAGLE rounds fed on the device by the verify step, dispatched right behind it.

In the steady state (every sequence of a verify step had proposals, and the head's cache of each holds its
pairs up to the step's first position), the next round's catch-up is exactly the tokens the verify step emits:
the pairs (emitted token j, target hidden state at position N - 1 + j), j < num_emitted. So the round need not
wait for the host: the engine dispatches it right after the verify step, with the verify step's token arrays
(still on the device) as its input, and reads the proposals back only after it has applied the verify step's
tokens (stops, detokenizing, outputs): that host work overlaps the round's device time, and the round's own
dispatch overlaps the verify step's. The catch-up batch is laid out on the device (``fed_metadata``); what
the host knows in advance (each sequence's first position and its block table, wide enough for any
acceptance) travels as ordinary inputs.

Whatever the host then finds (a request finished, or a stop cut the tokens), proposals it cannot use are
dropped and that request takes the ordinary round (jaxserve.spec_decode.eagle) from its recorded state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.spec_decode.draft_program import RoundPrograms, unrolled


def fed_metadata(num_emitted, start, block_tables, block_size: int, num_slots: int, width: int):
    """The catch-up's ragged layout, from the verify step's output: sequence s runs num_emitted[s] pairs at
    positions start[s] .. (start[s] = -1: padding, no pairs). T = S * width, padding tokens last.
    -> (index [T]: the (s, j) each token reads, flat s * width + j; AttentionMetadata)."""
    s = start.shape[0]
    t = s * width
    real = start >= 0  # [S]
    e = jnp.where(real, num_emitted, 0)  # [S] pairs per sequence
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(e).astype(jnp.int32)])  # [S+1]
    f = jnp.arange(t, dtype=jnp.int32)  # [T]
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], f, side="right").astype(jnp.int32), s - 1)  # [T]
    j = f - qsl[seq]  # [T]
    real_tok = f < qsl[-1]  # [T]
    pos = jnp.where(real_tok, start[seq] + j, 0)  # [T]
    block = jnp.take_along_axis(block_tables[seq], (pos // block_size)[:, None], axis=1)[:, 0]  # [T]
    md = AttentionMetadata(
        positions=pos,
        slot_mapping=jnp.where(real_tok, block * block_size + pos % block_size, num_slots),
        token_seq_ids=jnp.where(real_tok, seq, s - 1),
        query_start_loc=qsl,
        seq_lens=jnp.where(real, start + e, 0),
        block_tables=block_tables,
        logits_indices=jnp.maximum(qsl[1:] - 1, 0),
    )
    return seq * width + j, md


def propose_fed(
    tgraph, ttree, hgraph, htree, k, block_size, num_slots, unroll,
    target_params, head_params, head_kv, store, d2t, tokens, num_emitted, start, block_tables,
):  # fmt: skip
    """(target params, head params, head cache [donated], hidden store, d2t, the verify step's tokens [S, K+1]
    and num_emitted [S] (on the device), start [S] i32 (N - 1, or -1 for padding), block tables [S, B])
    -> (proposals [S, k] i32, new head cache)."""
    from jaxserve.spec_decode.eagle import eagle_round

    index, md = fed_metadata(num_emitted, start, block_tables, block_size, num_slots, tokens.shape[1])
    ids = jnp.where(md.slot_mapping < num_slots, tokens.reshape(-1)[index], 0)  # [T]
    target = nnx.merge(tgraph, jax.tree.unflatten(ttree, target_params))
    head = nnx.merge(hgraph, jax.tree.unflatten(htree, head_params))
    return eagle_round(target, head, head_kv, store, d2t, ids, md, k, block_size, num_slots, unroll)


class FedPrograms(RoundPrograms):
    """One compiled fed round per (S, B) of the verify steps (S: their sequence bucket)."""

    name = "EAGLE fed round"

    def __init__(self, rounds, k: int) -> None:
        r = rounds.runner
        self.rounds = rounds  # the EaglePrograms: weights, head cache, store, d2t
        fn = functools.partial(
            propose_fed, r.graphdef, r._treedef, rounds.head_graph, rounds.head_tree, k, r.block_size,
            r.num_blocks * r.block_size, unrolled(),
        )  # fmt: skip
        super().__init__(r, k, jax.jit(fn, donate_argnums=2))

    def _lead(self) -> tuple:
        return self.rounds._lead()

    def _keep(self, cache) -> None:
        self.rounds._keep(cache)

    def shapes(self) -> list[tuple[int, int]]:
        from jaxserve import buckets

        r = self.runner
        return sorted({(buckets.seq_bucket_for(t, r.scheduler_config.max_num_seqs), b) for t, b in super().shapes()
                       if t >= 2})

    def _args(self, shape: tuple[int, int], x=None) -> tuple:
        import numpy as np

        if x is not None:
            return x
        s, b = shape
        # Dummy inputs: tokens [S, K+1], num_emitted [S], start [S] (all padding), block tables [S, B].
        return (np.zeros((s, self.k + 1), np.int32), np.zeros(s, np.int32), np.full(s, -1, np.int32),
                np.zeros((s, b), np.int32))

    def _key(self, x) -> tuple[int, int]:
        return x[3].shape

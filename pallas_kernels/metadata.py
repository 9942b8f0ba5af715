"""The per-step attention metadata: the one contract between the model runner and attention kernels.

A step is a *ragged batch*: T flat tokens belonging to S sequences. Sequence s owns the tokens
``query_start_loc[s]:query_start_loc[s+1]``; those are its newest ``q_len`` tokens, at positions
``seq_lens[s] - q_len .. seq_lens[s] - 1``. Prefill chunks and decodes (q_len == 1) mix freely.

T, S and the block-table width are padded to buckets by the runner, so every field has a static shape:
- padding tokens have ``slot_mapping == num_blocks * block_size`` (out of range: their KV write is
  dropped) and ``token_seq_ids == S - 1`` pointing at a padding sequence or the last real one (their
  outputs are garbage and ignored);
- padding sequences have an empty query range (``query_start_loc`` repeats) and ``seq_lens == 0``.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs to read and write the paged KV cache for one step."""

    positions: jax.Array  # [T] int32: position of each token in its sequence (also drives RoPE)
    slot_mapping: jax.Array  # [T] int32: flat KV slot (block_id * block_size + offset) to write
    token_seq_ids: jax.Array  # [T] int32: which sequence each token belongs to
    query_start_loc: jax.Array  # [S+1] int32: prefix sums of per-sequence query lengths
    seq_lens: jax.Array  # [S] int32: context length of each sequence including this step's tokens
    block_tables: jax.Array  # [S, max_blocks] int32: physical block ids of each sequence's pages
    logits_indices: jax.Array  # [S] int32: flat index of each sequence's last token this step
    # Static: every sequence has at most ``decode_query_len`` new tokens (a pure decode step, or with 1 + k a pure
    # speculative verify step). A kernel may then skip its prefill path: the GPU backend launches no prefill
    # kernel (an empty one cost ~5 µs per layer) and its decode kernel takes the 1 + k tokens of a sequence.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    decode_query_len: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

"""Host-side building of one step's padded input arrays from the scheduler's output (numpy only)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from jaxserve.scheduler_output import ScheduledSeq


@dataclasses.dataclass
class StepInputs:
    """Padded numpy arrays for one step; field meanings as in AttentionMetadata."""

    input_ids: np.ndarray  # [T] int32: 0 where the token comes from the device (prev_index >= 0)
    prev_index: np.ndarray  # [T] int32: row of the previous step's samples holding this token, or -1
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    token_seq_ids: np.ndarray  # [T] int32
    query_start_loc: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32
    block_tables: np.ndarray  # [S, B] int32
    logits_indices: np.ndarray  # [S] int32
    lora_slots: np.ndarray | None = None  # [T] int32: each token's LoRA slot (0: none); only with enable_lora


def build_step_inputs(
    seqs: list[ScheduledSeq],
    *,
    num_tokens_padded: int,
    num_seqs_padded: int,
    block_width: int,
    block_size: int,
    num_blocks: int,
    lora_slots: list[int] | None = None,  # [s_real]: each sequence's LoRA slot, with enable_lora
) -> StepInputs:
    """Flatten the ragged batch and pad it to (T, S, B). Padding as AttentionMetadata's docstring says."""
    if len(seqs) == 1:
        return _one_sequence(seqs[0], num_tokens_padded, num_seqs_padded, block_width, block_size, num_blocks, lora_slots)
    return _ragged(seqs, num_tokens_padded, num_seqs_padded, block_width, block_size, num_blocks, lora_slots)


def _ragged(
    seqs: list[ScheduledSeq], t_pad: int, s_pad: int, block_width: int, block_size: int, num_blocks: int,
    lora_slots: list[int] | None,
) -> StepInputs:
    """build_step_inputs for any batch: per-sequence lengths gathered once, then whole-array numpy operations."""
    s_real = len(seqs)
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int32, s_real)  # [s_real]
    starts = np.fromiter((s.start_pos for s in seqs), np.int32, s_real)  # [s_real]
    t_real = int(q_lens.sum())

    input_ids = np.zeros(t_pad, np.int32)
    input_ids[:t_real] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int32, t_real)

    query_start_loc = np.full(s_pad + 1, t_real, np.int32)
    query_start_loc[0] = 0
    np.cumsum(q_lens, out=query_start_loc[1 : s_real + 1])

    # Placeholders (a sequence's last token, sampled by the step in flight) come from the device.
    prev_index = np.full(t_pad, -1, np.int32)
    placeholder_rows = [i for i, s in enumerate(seqs) if s.num_placeholders]
    if placeholder_rows:
        last = query_start_loc[1:][placeholder_rows] - 1  # [p] each one's (last) token
        prev_index[last] = [seqs[i].prev_row for i in placeholder_rows]
        input_ids[last] = 0

    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[:s_real] = starts + q_lens

    token_seq_ids = np.full(t_pad, s_pad - 1, np.int32)
    token_seq_ids[:t_real] = np.repeat(np.arange(s_real, dtype=np.int32), q_lens)

    positions = np.zeros(t_pad, np.int32)
    positions[:t_real] = np.arange(t_real, dtype=np.int32) - np.repeat(query_start_loc[:s_real] - starts, q_lens)

    block_tables = _block_tables(seqs, -(-seq_lens[:s_real] // block_size), s_pad, block_width)

    slot_mapping = np.full(t_pad, num_blocks * block_size, np.int32)  # out of range: write dropped
    tok_pos = positions[:t_real]
    slot_mapping[:t_real] = block_tables[token_seq_ids[:t_real], tok_pos // block_size] * block_size + tok_pos % block_size

    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[:s_real] = query_start_loc[1 : s_real + 1] - 1

    token_lora_slots = None
    if lora_slots is not None:
        token_lora_slots = np.zeros(t_pad, np.int32)  # padding tokens: slot 0, no adapter
        token_lora_slots[:t_real] = np.repeat(np.asarray(lora_slots, np.int32), q_lens)

    return StepInputs(
        lora_slots=token_lora_slots,
        input_ids=input_ids,
        prev_index=prev_index,
        positions=positions,
        slot_mapping=slot_mapping,
        token_seq_ids=token_seq_ids,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        logits_indices=logits_indices,
    )


def _one_sequence(
    seq: ScheduledSeq, t_pad: int, s_pad: int, block_width: int, block_size: int, num_blocks: int,
    lora_slots: list[int] | None,
) -> StepInputs:
    """build_step_inputs for a batch of one sequence (the single stream, where speculative decoding pays and
    nothing hides the host's time between a verify step and the next): the same arrays in about half the numpy
    calls, with no flattening, repeats or scatters."""
    q = len(seq.token_ids)
    start = seq.start_pos
    end = start + q
    input_ids = np.zeros(t_pad, np.int32)
    input_ids[:q] = seq.token_ids
    prev_index = np.full(t_pad, -1, np.int32)
    if seq.num_placeholders:  # the last token comes from the device
        prev_index[q - 1] = seq.prev_row
        input_ids[q - 1] = 0
    query_start_loc = np.full(s_pad + 1, q, np.int32)
    query_start_loc[0] = 0
    seq_lens = np.zeros(s_pad, np.int32)
    seq_lens[0] = end
    token_seq_ids = np.full(t_pad, s_pad - 1, np.int32)
    token_seq_ids[:q] = 0
    positions = np.zeros(t_pad, np.int32)
    positions[:q] = range(start, end)
    needed = -(-end // block_size)
    if len(seq.block_ids) < needed:
        raise ValueError(f"sequence {seq.req_id!r} holds {len(seq.block_ids)} blocks but needs {needed}")
    block_tables = np.zeros((s_pad, block_width), np.int32)
    block_tables[0, :needed] = seq.block_ids[:needed]
    slot_mapping = np.full(t_pad, num_blocks * block_size, np.int32)  # out of range: write dropped
    tok_pos = positions[:q]
    slot_mapping[:q] = block_tables[0, tok_pos // block_size] * block_size + tok_pos % block_size
    logits_indices = np.zeros(s_pad, np.int32)
    logits_indices[0] = q - 1
    token_lora_slots = None
    if lora_slots is not None:
        token_lora_slots = np.zeros(t_pad, np.int32)
        token_lora_slots[:q] = lora_slots[0]
    return StepInputs(input_ids, prev_index, positions, slot_mapping, token_seq_ids, query_start_loc, seq_lens,
                      block_tables, logits_indices, token_lora_slots)  # fmt: skip


def _block_tables(seqs: list[ScheduledSeq], num_blocks: np.ndarray, s_pad: int, block_width: int) -> np.ndarray:
    """[S, B] i32: each sequence's first ``num_blocks[i]`` block ids, 0 padded. One flat copy of every table and
    one scatter, not a numpy write per sequence."""
    s_real = len(seqs)
    block_tables = np.zeros((s_pad, block_width), np.int32)
    lens = np.fromiter((len(s.block_ids) for s in seqs), np.int64, s_real)  # [s_real]
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(s.block_ids for s in seqs), np.int32, total)  # [total]
    owner = np.repeat(np.arange(s_real), lens)  # [total] the sequence each id belongs to
    column = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)  # [total] its place in that table
    if np.any(lens < num_blocks):
        bad = int(np.argmax(lens < num_blocks))
        raise ValueError(f"sequence {seqs[bad].req_id!r} holds {lens[bad]} blocks but needs {num_blocks[bad]}")
    used = column < num_blocks[owner]  # a table may hold blocks past this step's tokens (e.g. proposals')
    block_tables[owner[used], column[used]] = flat[used]
    return block_tables


"""build_step_inputs: the single-sequence path gives the general path's arrays."""

import dataclasses

import numpy as np
import pytest

from jaxserve.batch_builder import _ragged, build_step_inputs
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import ScheduledSeq


@pytest.mark.parametrize("lora", [False, True])
def test_one_sequence_matches_the_ragged_path(lora):
    rng = np.random.default_rng(int(lora))
    sp = SamplingParams(temperature=0.0)
    block_size, num_blocks = 4, 64
    for _ in range(200):
        start = int(rng.integers(0, 40))
        q = int(rng.integers(1, 9))
        placeholder = bool(rng.random() < 0.3)
        token_ids = rng.integers(0, 100, q).tolist()
        if placeholder:
            token_ids[-1] = -1
        needed = -(-(start + q) // block_size)
        blocks = rng.permutation(np.arange(1, num_blocks))[: needed + int(rng.integers(0, 3))].tolist()  # may hold more
        seq = ScheduledSeq("r", token_ids, start, blocks, True, sp, 0, 0, [], 1, (), int(placeholder),
                           int(rng.integers(0, 4)) if placeholder else -1, int(rng.integers(0, q)))  # fmt: skip
        t_pad = 1 << max(3, (q - 1).bit_length())
        s_pad, width = int(rng.choice([1, 2, 4])), 16
        slots = [int(rng.integers(0, 3))] if lora else None
        fast = build_step_inputs([seq], num_tokens_padded=t_pad, num_seqs_padded=s_pad, block_width=width,
                                 block_size=block_size, num_blocks=num_blocks, lora_slots=slots)  # fmt: skip
        general = _ragged([seq], t_pad, s_pad, width, block_size, num_blocks, slots)
        for f in dataclasses.fields(fast):
            a, b = getattr(fast, f.name), getattr(general, f.name)
            assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), f.name


def test_one_sequence_too_few_blocks():
    seq = ScheduledSeq("r", [1, 2, 3], 4, [5], True, SamplingParams(), 0, 0, [], 1)
    with pytest.raises(ValueError, match="'r' holds 1 blocks but needs 2"):
        build_step_inputs([seq], num_tokens_padded=8, num_seqs_padded=1, block_width=4, block_size=4, num_blocks=8)

"""Benchmark workloads: random prompts with varied input and output lengths (seeded, reproducible)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np


@dataclasses.dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_workload(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int = 0,
    token_range: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    """Lengths drawn uniformly from [len * (1 - ratio), len * (1 + ratio)] (vLLM's --random-range-ratio)."""
    rng = np.random.default_rng(seed)
    lo_tok, hi_tok = token_range or (0, vocab_size)

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num_prompts)

    ins, outs = lengths(input_len), lengths(output_len)
    return [
        BenchRequest(rng.integers(lo_tok, hi_tok, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)
    ]


def dataset_workload(path: str, tokenizer, output_len: int) -> list[BenchRequest]:
    """A JSON list of {"prompt": str, "output_len": int?} objects."""
    with open(path) as f:
        items = json.load(f)
    return [BenchRequest(tokenizer.encode(it["prompt"]), int(it.get("output_len", output_len))) for it in items]

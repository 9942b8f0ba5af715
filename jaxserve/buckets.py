"""Static-shape buckets: every step is padded up to one of a few shapes, all compiled at start-up."""

from __future__ import annotations

import bisect


def _doubling(start: int, stop: int) -> list[int]:
    """start, 2*start, ... up to and including stop (stop itself is always the last bucket)."""
    out, b = [], start
    while b < stop:
        out.append(b)
        b *= 2
    out.append(stop)
    return out


# Decode buckets below 16 tokens, CPU only. On CPU the padded tokens cost real matmul work, so one
# decode padded to 16 tokens costs ~3x (SmolLM2-135M fp32, 2 shared cores, jitted step alone, best of
# 15 interleaved: 1 token 61 ms, 4 tokens 96, 16 tokens 171). Each bucket is one more compiled shape per
# block-width bucket (2-20 s each on CPU), so only 1 (a single stream) and 4 (a few streams). On GPU a
# small decode step reads the same weights as a 16-token one and costs about the same.
CPU_DECODE_BUCKETS = (1, 4)

# Between the powers of two, CPU only: a decode step of 33-48 sequences pads to 48, not 64. Where a step's
# matmuls are compute-bound, the 16 padding rows cost a quarter of the step: the default model's 48-request
# mixed workload (docs/BENCHMARKS.md §33) ran its 33 decode steps of 33-48 sequences in 212 ms each at 48
# against 239-260 ms at 64, 22.4-22.5 s in all against 23.9-25.3 s. One more compiled shape per block width.
CPU_MID_BUCKETS = (48,)


def token_buckets(max_num_batched_tokens: int, platform: str = "gpu", smallest: int = 16) -> list[int]:
    """Padded flat-token counts T: powers of two from ``smallest`` up to the token budget, below them
    the platform's small decode buckets (``CPU_DECODE_BUCKETS`` on "cpu", none elsewhere), and on "cpu"
    ``CPU_MID_BUCKETS`` between them."""
    large = _doubling(min(smallest, max_num_batched_tokens), max_num_batched_tokens)
    if platform != "cpu":
        return large
    small = {b for b in CPU_DECODE_BUCKETS if b < large[0]}
    mid = {b for b in CPU_MID_BUCKETS if large[0] < b < large[-1]}
    return sorted(small | mid | set(large))


def seq_bucket_for(num_tokens_bucket: int, max_num_seqs: int) -> int:
    """Padded sequence count S for a token bucket: a step has at most min(T, max_num_seqs) sequences.

    Tying S to T keeps the number of compiled shapes equal to the number of token buckets.
    """
    return min(num_tokens_bucket, max_num_seqs)


def block_width_buckets(max_blocks_per_seq: int, block_size: int, full_width_only: bool) -> list[int]:
    """Block-table widths B. A kernel that loops over the real context needs only the full width; the
    jnp backends gather B * block_size slots per sequence, so they get context buckets: 256, 512, 1024,
    then x4 (4096, ...). The x2 steps cover the common short contexts closely (decodes just past 256
    would otherwise pay for 1024); x4 beyond keeps the number of compiled shapes small."""
    if full_width_only:
        return [max_blocks_per_seq]
    out, b = [], max(1, 256 // block_size)
    while b < max_blocks_per_seq:
        out.append(b)
        b *= 2 if b * block_size < 1024 else 4
    out.append(max_blocks_per_seq)
    return out


def pick(buckets: list[int], value: int) -> int:
    """The smallest bucket >= value."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def startup_shapes(token_buckets: list[int], width_buckets: list[int], policy: str) -> list[tuple[int, int]]:
    """The (tokens, block width) step shapes to compile before serving; any other shape compiles on first use.

    "all": every pair. "common": every token bucket at the shortest context width, which serves every step
    whose longest sequence fits it (a chat of a few hundred tokens never waits for a compile); longer contexts
    compile when first reached. "none": nothing ahead.
    """
    if policy == "all":
        return [(t, b) for t in token_buckets for b in width_buckets]
    if policy == "common":
        return [(t, width_buckets[0]) for t in token_buckets]
    if policy == "none":
        return []
    raise ValueError(f"precompile={policy!r} is not one of ('all', 'common', 'none')")

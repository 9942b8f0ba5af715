"""On-device sampling: one pure, jittable function from the last-token logits to the next tokens.

Per row, in order: logit bias, penalties, bans and a grammar's mask on the raw logits -> greedy rows take the
argmax -> temperature -> top-k -> top-p -> min-p -> a seeded Gumbel-max draw. Logprobs, when asked for, are
those of the raw model distribution (before penalties and temperature), as vLLM reports by default.

Filters as one threshold. Top-k, top-p and min-p each keep the tokens whose probability is at or
above some per-row value, and applying them in order keeps ``p >= max(t_k, t_p, t_min)``: min-p's
``min_p * p_max`` is the same before or after renormalising, and top-p runs on the top-k survivors.
So the sampler finds three numbers per row and masks once.

Finding t_k and t_p needs the sorted probabilities, but only down to the k-th / nucleus boundary.
The sampler first takes the exact top ``FILTER_CAP`` probabilities of each row with ``exact_top_k``
(block maxima prune the vocabulary to a few thousand candidates, then two small top-k's) and reads
both thresholds off those. Only when some row's top_k exceeds the cap, or its nucleus is wider than
the cap (a very flat distribution), does a ``lax.cond`` fall back to a full sort, so the result is
always exact.

Measured on one H200, V = 152064, S = 256 (ms per call, jax 0.11): greedy 0.15; seeded draw 0.63;
draw with top-k/top-p/min-p 1.4 (4.3 when the full-sort fallback runs; a full sort alone is 2.8);
logprobs add 0.3 (``exact_top_k`` for the top 20 takes 0.22 where ``lax.top_k`` takes 3.0, since
XLA sorts whole rows for k > 16); penalties with a 1024-token history add 0.55.

Randomness. A row's key is ``fold_in(key(seed), step)`` with step = tokens generated so far: the same
seed gives the same tokens whatever else is in the batch and whichever row the request lands on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.sampling_metadata import SamplingMetadata
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.scheduler_output import ModelRunnerOutput

# Top-k / top-p are resolved from each row's FILTER_CAP most likely tokens (full sort beyond that).
FILTER_CAP = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """The sampled tokens and, when the batch asked for them, their raw-distribution logprobs."""

    token_ids: jax.Array  # [S] i32
    sampled_logprobs: Optional[jax.Array] = None  # [S] f32: logprob of token_ids under the raw logits
    sampled_ranks: Optional[jax.Array] = None  # [S] i32: 1 + number of tokens with a higher logprob
    top_token_ids: Optional[jax.Array] = None  # [S, MAX_LOGPROBS] i32: most likely first
    top_logprobs: Optional[jax.Array] = None  # [S, MAX_LOGPROBS] f32


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    """Next token per row from ``logits`` [S, V]; pure and jittable (``md``'s flags are static)."""
    raw = logits.astype(jnp.float32)  # [S, V]
    logits = apply_logit_bias(raw, md) if md.needs_bias else raw  # [S, V]
    logits = apply_penalties(logits, md) if md.needs_penalties else logits  # [S, V]
    if md.needs_bans:  # static: an all-greedy batch without bans is a bare argmax of the logits
        logits = _apply_bans(logits, md.banned)  # [S, V]
    if md.needs_mask:
        logits = apply_token_mask(logits, md.token_mask)  # [S, V]
    token_ids = argmax(logits)  # [S]
    if not md.all_greedy:
        drawn = _draw(logits, md)  # [S]
        token_ids = jnp.where(md.temperature > 0, drawn, token_ids)
    if not md.needs_logprobs:
        return SamplerOutput(token_ids=token_ids)
    return _with_logprobs(raw, token_ids)


def _apply_bans(logits: jax.Array, banned: jax.Array) -> jax.Array:
    """-inf at each row's banned ids ([S, MAX_BANNED], -1 = none: sent out of range and dropped)."""
    num_rows, vocab = logits.shape
    ids = jnp.where(banned >= 0, banned, vocab)  # [S, M]
    return logits.at[jnp.arange(num_rows)[:, None], ids].set(-jnp.inf, mode="drop")


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """-inf at every token a row's grammar does not allow: ``mask`` [S, W] i32 holds token t at bit t % 32 of word
    t // 32 (jaxserve.structured_output); rows without a grammar are all ones."""
    ids = jnp.arange(logits.shape[-1])  # [V]
    allowed = (mask[:, ids // 32] >> (ids % 32)) & 1  # [S, V]: an arithmetic shift, so bit 31 reads right too
    return jnp.where(allowed != 0, logits, -jnp.inf)


def apply_logit_bias(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Each row's logit_bias added to its logits ([S, M] ids, -1 = none: sent out of range and dropped)."""
    num_rows, vocab = logits.shape
    ids = jnp.where(md.bias_ids >= 0, md.bias_ids, vocab)  # [S, M]
    return logits.at[jnp.arange(num_rows)[:, None], ids].add(md.bias_values, mode="drop")


def apply_penalties(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """HF/vLLM semantics: repetition penalty over prompt + generated tokens, then frequency and
    presence penalties over generated tokens only. [S, V] -> [S, V]."""
    num_rows, vocab = logits.shape
    history = md.history  # [S, L]
    valid = history >= 0  # [S, L]
    # -1 padding would wrap around to the last token in a scatter; send it out of range to be dropped.
    ids = jnp.where(valid, history, vocab)  # [S, L]
    generated = valid & (jnp.arange(history.shape[1])[None, :] >= md.prompt_lens[:, None])  # [S, L]
    rows = jnp.arange(num_rows)[:, None]  # [S, 1]
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, ids].add(generated, mode="drop")  # [S, V]
    seen = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].set(True, mode="drop")  # [S, V]
    rep = md.repetition_penalty[:, None]  # [S, 1]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - md.frequency_penalty[:, None] * counts
    return logits - md.presence_penalty[:, None] * (counts > 0)


def _draw(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """Temperature, filters and a Gumbel-max draw with each row's own key. [S, V] -> [S] i32."""
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)  # [S]: greedy rows are replaced later
    scaled = logits / temperature[:, None]  # [S, V]
    if md.needs_filters:
        probs = jax.nn.softmax(scaled, axis=-1)  # [S, V]
        threshold = jnp.maximum(_top_k_top_p_threshold(probs, md.top_k, md.top_p), md.min_p * probs.max(-1))  # [S]
        scaled = jnp.where(probs >= threshold[:, None], scaled, -jnp.inf)
    keys = jax.vmap(_row_key)(md.seeds, md.steps)  # [S] keys
    vocab = logits.shape[-1]
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)  # [S, V]
    return argmax(scaled + gumbel)


# Block width of ``argmax``'s first pass: 128 f32 lanes, a few vector registers per block.
_ARGMAX_BLOCK = 128


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` of ``x`` [S, V] as int32 [S] (first index of the row maximum), in
    plain max/min reductions: XLA:CPU runs argmax's (value, index) pair reduction element by element
    (18 ms for [64, 49152] on 2 cores, where this takes 0.8 ms, measured). The maximum is found per
    block of ``_ARGMAX_BLOCK`` entries, then the first index of it inside the first block holding it.
    A row holding NaN gives some index in range, not necessarily the NaN's."""
    num_rows, vocab = x.shape
    num_blocks = -(-vocab // _ARGMAX_BLOCK)
    pad = num_blocks * _ARGMAX_BLOCK - vocab
    padded = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x  # [S, NB * BL]
    blocks = padded.reshape(num_rows, num_blocks, _ARGMAX_BLOCK)  # [S, NB, BL]
    block_max = blocks.max(-1)  # [S, NB]
    row_max = block_max.max(-1, keepdims=True)  # [S, 1]
    first_block = _first_true(block_max == row_max)  # [S]
    inside = jnp.take_along_axis(blocks, first_block[:, None, None], axis=1, mode="clip")[:, 0]  # [S, BL]
    index = first_block * _ARGMAX_BLOCK + _first_true(inside == row_max)  # [S]
    return jnp.minimum(index, vocab - 1)


def _first_true(mask: jax.Array) -> jax.Array:  # [S, N] bool -> [S] i32: first True column (N if none)
    n = mask.shape[-1]
    return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    # threefry named explicitly: a user's jax_default_prng_impl must not change which text a seed gives.
    return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), step)


def _top_k_top_p_threshold(probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row probability at or above which top-k then top-p keep a token. [S, V] -> [S] f32."""
    vocab = probs.shape[-1]
    total = probs.sum(-1)  # [S]: ~1, but summed as the full-sort path would
    best, _ = exact_top_k(probs, min(FILTER_CAP, vocab))  # [S, C] descending
    threshold, resolved = _threshold_from_sorted(best, top_k, top_p, total, vocab)

    def full_sort(_):
        ordered = jnp.flip(jnp.sort(probs, axis=-1), axis=-1)  # [S, V] descending
        return _threshold_from_sorted(ordered, top_k, top_p, total, vocab)[0]

    return lax.cond(jnp.all(resolved), lambda _: threshold, full_sort, None)


def _threshold_from_sorted(best: jax.Array, top_k, top_p, total, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Thresholds from each row's C largest probabilities ``best`` [S, C] (descending).

    Returns (threshold [S] f32, resolved [S] bool): resolved is False where the answer lies beyond
    the C candidates (top_k > C, or the nucleus is wider than C), and the caller must look further.
    """
    num_cand = best.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)  # [S]
    in_k = jnp.where(k_on[:, None], jnp.arange(num_cand)[None, :] < top_k[:, None], True)  # [S, C]
    kth = jnp.take_along_axis(best, jnp.clip(top_k - 1, 0, num_cand - 1)[:, None], axis=-1)[:, 0]  # [S]
    t_k = jnp.where(k_on, kth, 0.0)
    kept = jnp.where(in_k, best, 0.0)  # [S, C]
    cumulative = jnp.cumsum(kept, axis=-1)  # [S, C]
    # top-p runs on the renormalised top-k survivors: its target is a share of their mass.
    target = top_p * jnp.where(k_on, cumulative[:, -1], total)  # [S]
    # Keep token i while the mass strictly before it is below the target (HF/vLLM's rule), so the
    # last kept token is the first whose inclusive cumulative mass reaches the target.
    last = jnp.sum(cumulative < target[:, None], axis=-1)  # [S]
    p_on = top_p < 1.0  # [S]
    t_p = jnp.where(p_on, jnp.take_along_axis(best, jnp.clip(last, 0, num_cand - 1)[:, None], axis=-1)[:, 0], 0.0)
    resolved = (~k_on | (top_k <= num_cand)) & (~p_on | (cumulative[:, -1] >= target))  # [S]
    return jnp.maximum(t_k, t_p), resolved


def exact_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of each row of ``x`` [S, V], descending: (values [S, k], indices [S, k] i32).

    Same values as ``lax.top_k`` but cheaper for large V: a row's k largest entries all lie in the k
    blocks with the largest block maxima (an entry of any other block is beaten by those k maxima),
    so one pass of block maxima plus two small top-k's replaces a top-k over the whole vocabulary
    (XLA lowers a top-k over a long row with k > 16 to a full sort on GPU). Ties may list their
    indices in another order than ``lax.top_k``.
    """
    num_rows, vocab = x.shape
    block = _block_size(vocab, k)
    num_blocks = -(-vocab // block)
    if num_blocks <= k:  # too small to prune
        values, indices = lax.top_k(x, k)
        return values, indices.astype(jnp.int32)
    pad = num_blocks * block - vocab
    padded = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x  # [S, NB * B]
    blocks = padded.reshape(num_rows, num_blocks, block)  # [S, NB, B]
    _, top_blocks = lax.top_k(blocks.max(-1), k)  # [S, k]
    candidates = jnp.take_along_axis(blocks, top_blocks[:, :, None], axis=1).reshape(num_rows, k * block)  # [S, k*B]
    values, where = lax.top_k(candidates, k)  # [S, k]
    indices = jnp.take_along_axis(top_blocks, where // block, axis=1) * block + where % block  # [S, k]
    return values, indices.astype(jnp.int32)


def _block_size(vocab: int, k: int) -> int:
    # Balance the two small top-k's: V/B block maxima against k*B candidates, B a power of two.
    return 1 << max(0, round(math.log2(max(1.0, math.sqrt(vocab / k)))))


def _with_logprobs(raw: jax.Array, token_ids: jax.Array) -> SamplerOutput:
    """Raw-distribution logprobs of the sampled tokens, their ranks and the top MAX_LOGPROBS."""
    logprobs, ranks, top_ids, top_logprobs = token_logprobs(raw, token_ids)
    return SamplerOutput(
        token_ids=token_ids,
        sampled_logprobs=logprobs,
        sampled_ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def token_logprobs(raw: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per row of ``raw`` logits [R, V] (float32): the logprob of ``token_ids`` [R] under them, its rank (1 + the
    tokens with a higher logit), and the MAX_LOGPROBS most likely (ids [R, K] i32, logprobs [R, K]). Shared by
    the sampled tokens' logprobs and the prompt's (jaxserve.prompt_logprobs)."""
    lse = jax.nn.logsumexp(raw, axis=-1)  # [R]
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)  # [R, 1]
    # Rank compared on logits, not logprobs: subtracting lse could round distinct logits together.
    ranks = 1 + jnp.sum(raw > chosen, axis=-1, dtype=jnp.int32)  # [R]
    top_values, top_ids = exact_top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))  # [R, K]
    return chosen[:, 0] - lse, ranks, top_ids, top_values - lse[:, None]


def to_runner_output(out: SamplerOutput, num_rows: int) -> ModelRunnerOutput:
    """Host lists for the first ``num_rows`` rows. ``out`` may still be on device: its arrays are
    fetched with one ``jax.device_get`` (their copies overlap)."""
    out = jax.device_get(out)

    def rows(a):
        return np.asarray(a)[:num_rows].tolist()

    if out.sampled_logprobs is None:
        return ModelRunnerOutput(sampled_token_ids=rows(out.token_ids))
    return ModelRunnerOutput(
        sampled_token_ids=rows(out.token_ids),
        sampled_logprobs=rows(out.sampled_logprobs),
        sampled_ranks=rows(out.sampled_ranks),
        top_token_ids=rows(out.top_token_ids),
        top_logprobs=rows(out.top_logprobs),
    )

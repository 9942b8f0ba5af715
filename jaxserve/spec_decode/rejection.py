"""Which proposed tokens the target accepts, and the one token it adds: a pure, jittable function.

Position j = 0..num_spec of a sequence is its verify step's query token j, from its last known token on: the
logits there score proposal j (and, after the last proposal, give a bonus token). Only those positions get
logits, one row each, so the step pays for the proposals it has, not for K per padded sequence.

- Greedy rows accept the longest prefix of proposals equal to the target's argmax, then add the argmax at
  the first mismatch (or after the last proposal). The output is exactly greedy decoding's.
- Sampled rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Every proposer here is
  deterministic (n-gram lookup, a greedy draft model), so the draft distribution q is a point mass on the
  proposal d: d is accepted with probability min(1, p(d) / q(d)) = p(d), where p is the target's sampling
  distribution (temperature, top-k/top-p/min-p). At the first rejection the token comes from the recovered
  distribution norm(max(0, p - q)), which is p with d removed and renormalised; if all are accepted, the
  bonus token comes from p. Each emitted token is then distributed exactly as p.
- Randomness: position j of a row uses the key the plain sampler would use for that output token,
  ``fold_in(key(seed), num_output_tokens + j)``: the bonus draw is the plain sampler's own draw, and the
  acceptance uniform and the recovered draw take keys folded from it, so a seed gives the same text on any
  batch.

A logit_bias is part of p: the plain sampler adds it, and so does ``_target_logits``.

Penalties and min_tokens bans read the token history, which proposals would change mid-step, so the engine
proposes nothing for such rows (they verify position 0 only, through the plain sampler, exactly as today).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampler import _row_key, _top_k_top_p_threshold, apply_logit_bias, apply_token_mask, argmax, sample
from jaxserve.sampling_metadata import SamplingMetadata

# Distinct streams folded from a position's key: the plain sampler's Gumbel draw uses the key itself.
_UNIFORM_SALT = 0x5EC0
_RECOVERED_SALT = 0x5EC1


def accept(
    logits: jax.Array,
    rows: jax.Array,
    num_spec: jax.Array,
    md: SamplingMetadata,
    k: int,
    forced: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept proposals and add one token per sequence.

    The logits come only for the rows that matter: R rows, one per (sequence s, position j <= num_spec[s]).
    logits [R, V] f32; rows [3, R] i32: (proposal scored at this row or -1 after the last one, s, j), padding
    rows have s = S (dropped); num_spec [S] i32; md: one row per logits row, ``steps`` = tokens generated
    before position j. ``k`` (static) is the most proposals a sequence has; ``forced`` (benchmarks only,
    static): accept min(forced, num_spec) proposals regardless.
    Returns (tokens [S, K+1] i32: the first num_emitted of each row are the output, num_emitted [S] i32 in
    1..num_spec+1, emitted [R] i32: the token each row emits, if it emits one, for logprobs).
    """
    draft, seq, pos = rows[0], rows[1], rows[2]  # [R] each
    num_seqs = num_spec.shape[0]
    plain = dataclasses.replace(md, needs_logprobs=False)
    candidate = sample(logits, plain).token_ids  # [R]: the plain sampler's token at each row
    has_proposal = draft >= 0  # [R]
    if md.all_greedy:
        ok = draft == candidate  # [R]
        final = candidate
    else:
        greedy = md.temperature <= 0  # [R]
        scaled = _target_logits(logits, md)  # [R, V]
        keys = jax.vmap(_row_key)(md.seeds, md.steps)  # [R] keys
        probs = jax.nn.softmax(scaled, axis=-1)  # [R, V]
        p_draft = jnp.take_along_axis(probs, jnp.maximum(draft, 0)[:, None], axis=-1)[:, 0]  # [R]
        uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _UNIFORM_SALT)))(keys)  # [R]
        ok = jnp.where(greedy, draft == candidate, uniform < p_draft)
        # A rejected position's token is the recovered draw; after the last proposal it is the plain draw.
        final = jnp.where(greedy | ~has_proposal, candidate, _recovered(scaled, draft, keys))
    rejected_at = jnp.where(has_proposal & ~ok, pos, k + 1)  # [R]
    first_rejection = jax.ops.segment_min(rejected_at, seq, num_segments=num_seqs, mode="drop")  # [S]
    num_accepted = jnp.minimum(first_rejection, num_spec)  # [S]
    if forced is not None:
        num_accepted = jnp.minimum(num_spec, forced)
    accepted_here = num_accepted[jnp.minimum(seq, num_seqs - 1)]  # [R]
    emitted = jnp.where(pos < accepted_here, draft, final).astype(jnp.int32)  # [R]
    keep = pos <= accepted_here  # [R]
    tokens = jnp.zeros((num_seqs, k + 1), jnp.int32).at[seq, pos].set(jnp.where(keep, emitted, 0), mode="drop")
    return tokens, (num_accepted + 1).astype(jnp.int32), emitted


def _target_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The logits of the distribution a sampled row draws from (temperature, then the filters): the same
    steps as the sampler's draw, -inf where a filter removes a token. [R, V] -> [R, V]."""
    if md.needs_bias:
        logits = apply_logit_bias(logits, md)
    if md.needs_mask:  # a grammar's row (it has no proposals: it does not speculate) keeps its mask here too
        logits = apply_token_mask(logits, md.token_mask)
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)  # [R]
    scaled = logits / temperature[:, None]
    if md.needs_filters:
        probs = jax.nn.softmax(scaled, axis=-1)
        threshold = jnp.maximum(_top_k_top_p_threshold(probs, md.top_k, md.top_p), md.min_p * probs.max(-1))
        scaled = jnp.where(probs >= threshold[:, None], scaled, -jnp.inf)
    return scaled


def _recovered(scaled: jax.Array, draft: jax.Array, keys: jax.Array) -> jax.Array:
    """A draw from p with the proposal removed (max(0, p - q) for a point-mass q, renormalised). [R] i32.

    If the proposal held all of p's mass it is never rejected, so the all -inf row this could give is unused."""
    vocab = scaled.shape[-1]
    removed = jnp.where(jnp.arange(vocab)[None, :] == draft[:, None], -jnp.inf, scaled)  # [R, V]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, _RECOVERED_SALT), (vocab,)))(keys)
    return argmax(removed + gumbel)

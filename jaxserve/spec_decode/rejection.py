"""Which proposed tokens the target accepts, and the one token it adds: a pure, jittable function.

Rows are sequences, positions j = 0..K are the verify step's query tokens from the sequence's last known
token on: the logits at position j score proposal j (and, after the last proposal, give a bonus token).

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

Penalties and min_tokens bans read the token history, which proposals would change mid-step, so the engine
proposes nothing for such rows (they verify position 0 only, through the plain sampler, exactly as today).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sampler import _row_key, _top_k_top_p_threshold, argmax, sample
from jaxserve.sampling_metadata import SamplingMetadata

# Distinct streams folded from a position's key: the plain sampler's Gumbel draw uses the key itself.
_UNIFORM_SALT = 0x5EC0
_RECOVERED_SALT = 0x5EC1


def accept(
    logits: jax.Array, draft: jax.Array, num_spec: jax.Array, md: SamplingMetadata, forced: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Accept proposals and add one token per row.

    logits [S*(K+1), V] f32 (row s, position j at s*(K+1)+j); draft [S, K] i32; num_spec [S] i32 (proposals
    per row, 0..K); md: one row per (s, j), with ``steps`` = tokens generated before position j.
    Returns (tokens [S, K+1] i32: the first num_emitted of each row are the output, num_emitted [S] i32 in
    1..num_spec+1). ``forced`` (benchmarks only, static): accept min(forced, num_spec) proposals regardless.
    """
    num_rows, k = draft.shape
    positions = k + 1
    plain = dataclasses.replace(md, needs_logprobs=False)
    candidate = sample(logits, plain).token_ids.reshape(num_rows, positions)  # [S, K+1]: the plain sampler's token
    in_range = jnp.arange(k)[None, :] < num_spec[:, None]  # [S, K]
    greedy = (md.temperature <= 0).reshape(num_rows, positions)[:, 0]  # [S]
    if md.all_greedy:
        accepted = (draft == candidate[:, :k]) & in_range  # [S, K]
        final = candidate  # [S, K+1]
    else:
        scaled = _target_logits(logits, md)  # [S*(K+1), V]
        keys = jax.vmap(_row_key)(md.seeds, md.steps)  # [S*(K+1)] keys
        draft_flat = jnp.pad(draft, ((0, 0), (0, 1)), constant_values=-1).reshape(-1)  # [S*(K+1)]
        probs = jax.nn.softmax(scaled, axis=-1)  # [S*(K+1), V]
        p_draft = jnp.take_along_axis(probs, jnp.maximum(draft_flat, 0)[:, None], axis=-1)[:, 0]  # [S*(K+1)]
        uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _UNIFORM_SALT)))(keys)
        sampled_ok = (uniform < p_draft).reshape(num_rows, positions)[:, :k]  # [S, K]
        greedy_ok = draft == candidate[:, :k]  # [S, K]
        accepted = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & in_range
        recovered = _recovered(scaled, draft_flat, keys).reshape(num_rows, positions)  # [S, K+1]
        # A rejected position's token is the recovered draw; after the last proposal it is the plain draw.
        at_rejection = jnp.arange(positions)[None, :] < num_spec[:, None]  # [S, K+1]
        final = jnp.where(greedy[:, None] | ~at_rejection, candidate, recovered)
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # [S]
    if forced is not None:
        num_accepted = jnp.minimum(num_spec, forced)
    j = jnp.arange(positions)[None, :]  # [1, K+1]
    draft_wide = jnp.pad(draft, ((0, 0), (0, 1)))  # [S, K+1]
    chosen = jnp.take_along_axis(final, num_accepted[:, None], axis=1)  # [S, 1]
    tokens = jnp.where(j < num_accepted[:, None], draft_wide, jnp.where(j == num_accepted[:, None], chosen, 0))
    return tokens.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)


def _target_logits(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """The logits of the distribution a sampled row draws from (temperature, then the filters): the same
    steps as the sampler's draw, -inf where a filter removes a token. [R, V] -> [R, V]."""
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)  # [R]
    scaled = logits / temperature[:, None]
    if md.needs_filters:
        probs = jax.nn.softmax(scaled, axis=-1)
        threshold = jnp.maximum(_top_k_top_p_threshold(probs, md.top_k, md.top_p), md.min_p * probs.max(-1))
        scaled = jnp.where(probs >= threshold[:, None], scaled, -jnp.inf)
    return scaled


def _recovered(scaled: jax.Array, draft_flat: jax.Array, keys: jax.Array) -> jax.Array:
    """A draw from p with the proposal removed (max(0, p - q) for a point-mass q, renormalised). [R] i32.

    If the proposal held all of p's mass it is never rejected, so the all -inf row this could give is unused."""
    vocab = scaled.shape[-1]
    removed = jnp.where(jnp.arange(vocab)[None, :] == draft_flat[:, None], -jnp.inf, scaled)  # [R, V]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, _RECOVERED_SALT), (vocab,)))(keys)
    return argmax(removed + gumbel)

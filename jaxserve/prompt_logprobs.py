"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob given the tokens before it.

A step holding a prompt chunk that wants them runs a variant of the step program
(``step_program.forward_step_with_prompt_logprobs``, compiled on first use): besides the usual logits of each
sequence's last token, it scores every token's hidden state against ``targets`` [T], the prompt token that
follows it (the host knows it, also across chunk boundaries: ``targets_for``). The full [T, V] logits are never
held at once: they are computed ``CHUNK`` rows at a time, and only each row's logprob of its target, the target's
rank and the top MAX_LOGPROBS leave the loop. On the host the rows land on the request by position
(``Rows``, numpy arrays sized once), so a chunk computed twice (preemption by recompute) overwrites the same rows;
the Python dicts of RequestOutput.prompt_logprobs are built once the prompt is complete (``as_list``).

Scheduling: a request that still needs its prompt logprobs is admitted without prefix-cache hits (a cached
token is not computed, so it would have no logprobs; vLLM does the same). With n > 1 only the first sample
computes them; the others share its blocks as usual.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.outputs import LogprobsDict
from jaxserve.sampler import token_logprobs
from jaxserve.scheduler_output import ScheduledSeq

# Rows of logits computed at once: [CHUNK, V] float32 is 128 MiB at Llama 3's vocabulary.
CHUNK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per token of a step (device arrays, then numpy once fetched): its target's logprob and rank, and the top
    MAX_LOGPROBS. Rows whose target is -1 hold the values for token 0 and are never read."""

    logprobs: jax.Array  # [T] f32
    ranks: jax.Array  # [T] i32
    top_token_ids: jax.Array  # [T, K] i32
    top_logprobs: jax.Array  # [T, K] f32


def prompt_logprobs_of(model, hidden: jax.Array, targets: jax.Array) -> PromptLogprobs:
    """Inside the step: ``hidden`` [T, E] (final, normed) and ``targets`` [T] i32 -> PromptLogprobs, computed
    ``CHUNK`` rows at a time (lax.map), so that the step's memory grows by [CHUNK, V], not [T, V]."""
    t, e = hidden.shape
    c = min(t, CHUNK)
    n = -(-t // c)
    pad = n * c - t
    rows = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, c, e)  # [n, c, E]
    ids = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(n, c)  # [n, c]

    def one(chunk):
        h, tok = chunk
        return token_logprobs(model.compute_logits(h).astype(jnp.float32), tok)

    lp, rank, top_ids, top_lp = lax.map(one, (rows, ids))
    flat = lambda a: a.reshape(n * c, *a.shape[2:])[:t]  # noqa: E731
    return PromptLogprobs(flat(lp), flat(rank), flat(top_ids), flat(top_lp))


def targets_for(seqs: list[ScheduledSeq], num_tokens_padded: int) -> Optional[np.ndarray]:
    """[T] i32: for each token of a sequence that wants prompt logprobs, the prompt token after it (-1 past the
    prompt's second-to-last token, for other sequences and for padding); None when no sequence wants them (the
    plain step program runs)."""
    if not any(seq.prompt_logprobs for seq in seqs):
        return None
    targets = np.full(num_tokens_padded, -1, np.int32)
    offset = 0
    for seq in seqs:
        n = _num_scored(seq)
        if n > 0:
            targets[offset : offset + n] = seq.history[seq.start_pos + 1 : seq.start_pos + n + 1]
        offset += len(seq.token_ids)
    return targets


def _num_scored(seq: ScheduledSeq) -> int:
    """How many of the step's tokens of ``seq`` (its first ones) get a prompt logprob: those followed by a prompt
    token, if the sequence wants them."""
    if not seq.prompt_logprobs:
        return 0
    return max(0, min(len(seq.token_ids), seq.num_prompt_tokens - 1 - seq.start_pos))


class Rows:
    """A request's prompt logprobs as its prompt is computed: prompt position p (1 .. prompt length - 1) is row
    p - 1 of numpy arrays sized once (the top lists cut to the request's k). A step's rows arrive as slices
    (``put``), and a chunk computed twice (preemption by recompute) overwrites the same rows."""

    def __init__(self, num_prompt_tokens: int, k: int):
        n = max(0, num_prompt_tokens - 1)
        self.logprobs = np.zeros(n, np.float32)
        self.ranks = np.zeros(n, np.int32)
        self.top_token_ids = np.zeros((n, k), np.int32)
        self.top_logprobs = np.zeros((n, k), np.float32)
        self._filled = np.zeros(n, bool)
        self.num_filled = 0

    @property
    def complete(self) -> bool:
        return self.num_filled == len(self._filled)

    def put(self, first: int, out: PromptLogprobs, rows: slice) -> None:
        """Rows ``rows`` of a fetched step's ``out`` are prompt positions ``first``, ``first`` + 1, ..."""
        k = self.top_token_ids.shape[1]
        dst = slice(first - 1, first - 1 + rows.stop - rows.start)
        self.num_filled += int(dst.stop - dst.start - np.count_nonzero(self._filled[dst]))
        self._filled[dst] = True
        self.logprobs[dst] = out.logprobs[rows]
        self.ranks[dst] = out.ranks[rows]
        self.top_token_ids[dst] = out.top_token_ids[rows, :k]
        self.top_logprobs[dst] = out.top_logprobs[rows, :k]


def store(seqs: list[ScheduledSeq], requests: list, out: PromptLogprobs) -> None:
    """Put a fetched step's rows (numpy) on the requests that wanted them (their ``Rows``)."""
    offset = 0
    for seq, request in zip(seqs, requests):
        n = _num_scored(seq)
        if n > 0 and request.prompt_logprobs is not None and not request.status.finished:
            request.prompt_logprobs.put(seq.start_pos + 1, out, slice(offset, offset + n))
        offset += len(seq.token_ids)


def as_list(prompt_ids: list[int], rows: Rows, entry: Callable[..., LogprobsDict]) -> list[Optional[LogprobsDict]]:
    """RequestOutput.prompt_logprobs: None for the first token (nothing precedes it), then each position's dict
    (the prompt token, then the request's k most likely), built by ``entry`` as the sampled tokens' are. The arrays
    become Python lists in one call each, and the cyclic garbage collector waits until the list is built: these
    are several new objects per prompt token, none in a cycle, and every collection the allocations would trigger
    meanwhile walks the ones already made (it more than halved the build's time, BENCHMARKS §41)."""
    columns = (rows.logprobs.tolist(), rows.ranks.tolist(), rows.top_token_ids.tolist(), rows.top_logprobs.tolist())
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return [None, *(entry(*position) for position in zip(prompt_ids[1:], *columns))]
    finally:
        if was_enabled:
            gc.enable()


def complete(request) -> bool:
    """Whether every prompt position past the first has its entry."""
    return request.prompt_logprobs is not None and request.prompt_logprobs.complete

"""The verify step: one jitted call scores every proposal of every sequence and decides what is accepted.

A sequence with k proposals is scheduled with 1 + k query tokens (its last known token, then the
proposals), so the ragged batch and the attention kernels are the ordinary ones; only the logits differ:
K+1 rows per sequence (``logits_idx`` [S, K+1]) instead of one, and ``rejection.accept`` picks the tokens on
the device. One transfer brings back the tokens [S, K+1] and their count [S] (plus logprobs if asked).

This module shares the ModelRunner's weights and KV cache (the step donates the cache and hands it back to
the runner), and reuses its input packing; a step in which nobody has proposals goes through the runner's
own step unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.batch_builder import build_step_inputs
from jaxserve.model_runner import ModelRunner, pack_inputs, unpack_inputs
from jaxserve.sampler import _with_logprobs
from jaxserve.sampling_metadata import SamplingMetadata
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.spec_decode.rejection import accept


def _verify(graphdef, treedef, k, forced, params, kv_caches, tok_fields, seq_fields, spec_fields, md):
    """(params, cache, packed batch, spec_fields [S, 2K+2], md of S*(K+1) rows) ->
    (tokens [S, K+1], num_emitted [S], logprob outputs or None, new cache)."""
    input_ids, _, attn_md = unpack_inputs(tok_fields, seq_fields)
    logits_idx = spec_fields[:, : k + 1]  # [S, K+1]
    draft = spec_fields[:, k + 1 : 2 * k + 1]  # [S, K]
    num_spec = spec_fields[:, 2 * k + 1]  # [S]
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    hidden, kv_caches = model(input_ids, kv_caches, attn_md)  # [T, E]
    logits = model.compute_logits(hidden[logits_idx.reshape(-1)])  # [S*(K+1), V] f32
    tokens, num_emitted = accept(logits, draft, num_spec, md, forced)
    lp = _with_logprobs(logits, tokens.reshape(-1)) if md.needs_logprobs else None
    return tokens, num_emitted, lp, kv_caches


@dataclasses.dataclass
class VerifyHandle:
    tokens: jax.Array  # [S, K+1] i32, on the device until fetched
    num_emitted: jax.Array  # [S] i32
    logprobs: object  # SamplerOutput of S*(K+1) rows, or None
    num_rows: int


class VerifyRunner:
    """Runs verify steps over a ModelRunner's weights and KV cache, for ``k`` proposals per sequence at most."""

    def __init__(self, runner: ModelRunner, k: int, forced_acceptance_length: int | None = None) -> None:
        self.runner = runner
        self.k = k
        verify = functools.partial(_verify, runner.graphdef, runner._treedef, k, forced_acceptance_length)
        self._step = jax.jit(verify, donate_argnums=1)

    def dispatch(self, sched: SchedulerOutput):
        """Launch the step; without any proposal in it, the runner's own step (its output has one token a row)."""
        if not any(seq.num_spec_tokens for seq in sched.seqs):
            return self.runner.dispatch(sched)
        r, k = self.runner, self.k
        t, s, b = r._shapes_for(sched)
        x = build_step_inputs(
            sched.seqs, num_tokens_padded=t, num_seqs_padded=s, block_width=b, block_size=r.block_size,
            num_blocks=r.num_blocks,
        )
        spec = np.zeros((s, 2 * k + 2), np.int32)  # [S, 2K+2]: logits_idx [K+1] | draft [K] | num_spec [1]
        for i, seq in enumerate(sched.seqs):
            n = seq.num_spec_tokens
            last = int(x.query_start_loc[i + 1]) - 1
            # Position j's logits come from query token (last - n + j); positions past n repeat the last one.
            spec[i, : k + 1] = last - n + np.minimum(np.arange(k + 1), n)
            spec[i, k + 1 : k + 1 + n] = seq.token_ids[len(seq.token_ids) - n :]
            spec[i, 2 * k + 1] = n
        md = _expand(SamplingMetadata.from_seqs(sched.seqs, s, r._history_len(sched)), k + 1)
        tokens, num_emitted, lp, r.kv_caches = self._step(r.params, r.kv_caches, *pack_inputs(x), spec, md)
        r.num_steps += 1
        return VerifyHandle(tokens, num_emitted, lp, len(sched.seqs))

    def fetch(self, handle) -> ModelRunnerOutput:
        """Read a step back: ``emitted_token_ids`` per row (a plain step's one token becomes a list of one)."""
        if not isinstance(handle, VerifyHandle):
            out = self.runner.fetch(handle)
            return dataclasses.replace(out, emitted_token_ids=[[t] for t in out.sampled_token_ids])
        tokens, num_emitted, lp = jax.device_get((handle.tokens, handle.num_emitted, handle.logprobs))
        rows = handle.num_rows
        emitted = [row[:n].tolist() for row, n in zip(np.asarray(tokens)[:rows], np.asarray(num_emitted)[:rows])]
        out = ModelRunnerOutput(sampled_token_ids=[e[0] for e in emitted], emitted_token_ids=emitted)
        if lp is not None:
            flat = rows * (self.k + 1)

            def cut(a):
                return np.asarray(a)[:flat].tolist()

            out = dataclasses.replace(
                out, sampled_logprobs=cut(lp.sampled_logprobs), sampled_ranks=cut(lp.sampled_ranks),
                top_token_ids=cut(lp.top_token_ids), top_logprobs=cut(lp.top_logprobs), logprobs_stride=self.k + 1,
            )
        return out


def _expand(md: SamplingMetadata, positions: int) -> SamplingMetadata:
    """Each row repeated for the ``positions`` query positions of its sequence, position j's step + j."""
    fields = {}
    for f in dataclasses.fields(md):
        value = getattr(md, f.name)
        if isinstance(value, np.ndarray):
            fields[f.name] = np.repeat(value, positions, axis=0)
    fields["steps"] = fields["steps"] + np.tile(np.arange(positions, dtype=np.int32), md.num_rows)
    return dataclasses.replace(md, **fields)

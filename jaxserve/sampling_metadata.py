"""SamplingMetadata: each row's sampling settings as arrays, padded to the runner's S bucket.

Built on the host with numpy (``from_seqs``), passed into the jitted sampler as a pytree. The
flags are static (part of the jit cache key, not traced), so a batch that uses no penalties, filters
or logprobs compiles to a sampler that never computes them. The runner compiles the common flag
combinations at start-up (``warmup_variants``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional, Sequence

import jax
import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import ScheduledSeq
from jaxserve.structured_output import token_masks


# Most tokens a row can ban at once: EOS ids plus stop_token_ids while min_tokens is not reached.
MAX_BANNED = 16
# The width of the logit-bias arrays is a power of two from this up (one sampler program per width).
MIN_BIAS_WIDTH = 16


def _static(default: bool = False):
    return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one step. Arrays are numpy on the host and jax inside jit.

    Padding rows (and rows that sample nothing this step) are greedy with every feature off, so
    they cost nothing and their (ignored) outputs are well defined.
    """

    temperature: jax.Array  # [S] f32: 0 = greedy
    top_k: jax.Array  # [S] i32: 0 = off
    top_p: jax.Array  # [S] f32: 1 = off
    min_p: jax.Array  # [S] f32: 0 = off
    presence_penalty: jax.Array  # [S] f32: subtracted once from each token generated before
    frequency_penalty: jax.Array  # [S] f32: subtracted per occurrence in the generated tokens
    repetition_penalty: jax.Array  # [S] f32: divides positive / multiplies negative logits of seen tokens
    seeds: jax.Array  # [S] uint32: the request's seed
    steps: jax.Array  # [S] i32: tokens the request has generated so far, folded into the row's key
    history: jax.Array  # [S, L] i32: prompt then generated tokens, -1 padded; L = 0 without penalties
    prompt_lens: jax.Array  # [S] i32: how many of ``history``'s leading tokens are the prompt
    banned: jax.Array  # [S, MAX_BANNED] i32: tokens that may not be sampled (min_tokens), -1 padded
    all_greedy: bool = _static(True)  # every row takes the argmax: no random draws at all
    needs_penalties: bool = _static()  # some row has a presence / frequency / repetition penalty
    needs_filters: bool = _static()  # some sampled row uses top-k / top-p / min-p
    needs_logprobs: bool = _static()  # some row asked for logprobs
    needs_bans: bool = _static()  # some row has banned tokens (min_tokens not reached yet)
    needs_bias: bool = _static()  # some row has a logit_bias
    # logit_bias: [S, M] i32 token ids whose logits get bias_values [S, M] f32 added, -1 padded. from_seqs makes
    # them [S, 0] when no row has a bias (None: a hand-built batch without any).
    bias_ids: Optional[jax.Array] = None
    bias_values: Optional[jax.Array] = None
    # Structured outputs: [S, W] i32 bitmask of the tokens each row may sample (bit t % 32 of word t // 32; -1 for
    # rows without a grammar); [S, 0] when no row has one (None: a hand-built batch without any).
    token_mask: Optional[jax.Array] = None
    needs_mask: bool = _static()  # some row samples under a grammar

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the bare argmax of the model's logits: the step's own argmax is the sample."""
        return self.all_greedy and not (
            self.needs_penalties or self.needs_logprobs or self.needs_bans or self.needs_bias or self.needs_mask
        )

    @classmethod
    def from_seqs(
        cls, seqs: Sequence[ScheduledSeq], num_rows: int, history_len: int = 0, fill_masks: bool = True
    ) -> "SamplingMetadata":
        """Rows follow ``seqs``, padded to ``num_rows``.

        ``history_len`` (a bucket >= the longest ``seq.history``) sizes the penalty history; it is
        only read when some row uses penalties, and 0 then means "exactly the longest history".
        ``fill_masks=False``: grammar rows' token masks are left all-allowed, for the caller to fill
        (structured_output.fill_token_masks) once their grammars have taken the tokens still in flight.
        """
        if num_rows < len(seqs):
            raise ValueError(f"num_rows={num_rows} is smaller than the number of sequences ({len(seqs)})")
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        min_p = np.zeros(num_rows, np.float32)
        presence = np.zeros(num_rows, np.float32)
        frequency = np.zeros(num_rows, np.float32)
        repetition = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        steps = np.zeros(num_rows, np.int32)
        prompt_lens = np.zeros(num_rows, np.int32)
        banned = np.full((num_rows, MAX_BANNED), -1, np.int32)
        # A prefill chunk that samples nothing keeps the free greedy defaults. The rest are filled column by
        # column: one numpy write per column, not one per row and setting.
        rows = [i for i, seq in enumerate(seqs) if seq.sample]
        n = len(rows)
        sampled = seqs if n == len(seqs) else [seqs[i] for i in rows]  # [n]
        where = slice(0, n) if n == len(seqs) else np.asarray(rows, np.intp)  # rows as a numpy index, made once
        kinds: dict[int, int] = {}  # id(SamplingParams) -> its place in ``unique``: a batch often shares a few
        unique: list[SamplingParams] = []
        kind: list[int] = []  # [n] each row's place in ``unique``
        for seq in sampled:
            k = kinds.get(id(seq.sampling_params))
            if k is None:
                k = kinds[id(seq.sampling_params)] = len(unique)
                unique.append(seq.sampling_params)
            kind.append(k)
        if n:
            table = np.array([_row_settings(sp) for sp in unique], np.float64)[kind]  # [n, 7]
            for column, array in enumerate((temperature, top_p, min_p, presence, frequency, repetition, top_k)):
                array[where] = table[:, column]
            # One pass for the three per-row counters: [n, 3] (seed, tokens generated, prompt length)
            counters = np.fromiter(
                itertools.chain.from_iterable(
                    (seq.seed & 0xFFFFFFFF, seq.num_output_tokens, seq.num_prompt_tokens) for seq in sampled
                ),
                np.int64,
                3 * n,
            ).reshape(n, 3)
            seeds[where] = counters[:, 0]
            steps[where] = counters[:, 1]
            prompt_lens[where] = counters[:, 2]
        all_greedy = all(sp.greedy for sp in unique)
        needs_filters = any(sp.uses_filters for sp in unique)
        needs_logprobs = any(sp.logprobs is not None for sp in unique)
        needs_penalties = any(sp.uses_penalties for sp in unique)
        needs_bans = False
        if any(sp.min_tokens for sp in unique):
            for i in rows:
                seq = seqs[i]
                sp = seq.sampling_params
                if seq.num_output_tokens < sp.min_tokens:  # vLLM: stop tokens cannot be sampled before min_tokens
                    ban = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(seq.eos_token_ids))
                    banned[i, : len(ban)] = ban[:MAX_BANNED]
                    needs_bans |= len(ban) > 0
        bias_ids, bias_values = _logit_bias(seqs, rows, num_rows) if any(sp.logit_bias for sp in unique) else (
            np.full((num_rows, 0), -1, np.int32), np.zeros((num_rows, 0), np.float32))
        grammar_rows = [i for i in rows if seqs[i].grammar is not None] if any(
            sp.uses_token_mask for sp in unique) else []
        token_mask = (token_masks(seqs, grammar_rows, num_rows, fill_masks) if grammar_rows
                      else np.full((num_rows, 0), -1, np.int32))
        penalty_rows = [i for i in rows if seqs[i].sampling_params.uses_penalties] if needs_penalties else []
        history = _history(seqs, penalty_rows, num_rows, history_len) if needs_penalties else None
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            seeds=seeds,
            steps=steps,
            history=np.full((num_rows, 0), -1, np.int32) if history is None else history,
            prompt_lens=prompt_lens,
            banned=banned,
            bias_ids=bias_ids,
            bias_values=bias_values,
            token_mask=token_mask,
            all_greedy=all_greedy,
            needs_penalties=needs_penalties,
            needs_filters=needs_filters and not all_greedy,
            needs_logprobs=needs_logprobs,
            needs_bans=needs_bans,
            needs_bias=bias_ids.shape[1] > 0,
            needs_mask=token_mask.shape[1] > 0,
        )

    @classmethod
    def warmup_variants(cls, num_rows: int, with_logprobs: bool = True) -> Iterator["SamplingMetadata"]:
        """One dummy batch per flag combination worth compiling at start-up (the logprobs ones only if
        ``with_logprobs``).

        Penalties are left out: their shape also depends on the history bucket, so those variants
        compile on first use (a rarely used feature pays once, the common ones never). So are bans
        (min_tokens), for the same reason: rare, and a variant per flag doubles the start-up list.
        """
        base = cls.from_seqs([], num_rows)
        for all_greedy, needs_filters in ((True, False), (False, False), (False, True)):
            for needs_logprobs in (False, True) if with_logprobs else (False,):
                yield dataclasses.replace(
                    base, all_greedy=all_greedy, needs_filters=needs_filters, needs_logprobs=needs_logprobs
                )


def _row_settings(sp: SamplingParams) -> tuple:
    """A sampled row's (temperature, top_p, min_p, presence, frequency, repetition, top_k), as from_seqs's columns."""
    filters = not sp.greedy  # a greedy row's filters change nothing; left on they could force a full sort
    return (
        sp.temperature,
        sp.top_p if filters else 1.0,
        sp.min_p if filters else 0.0,
        sp.presence_penalty,
        sp.frequency_penalty,
        sp.repetition_penalty,
        sp.top_k if filters else 0,
    )


def _logit_bias(seqs: Sequence[ScheduledSeq], rows: list[int], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """([S, M] i32 ids, -1 padded; [S, M] f32 biases) of the sampled rows' logit_bias, M a power of two >= 16."""
    biased = [(i, seqs[i].sampling_params.logit_bias) for i in rows if seqs[i].sampling_params.logit_bias]
    longest = max(len(b) for _, b in biased)
    width = max(MIN_BIAS_WIDTH, 1 << (longest - 1).bit_length())
    ids = np.full((num_rows, width), -1, np.int32)
    values = np.zeros((num_rows, width), np.float32)
    for i, bias in biased:
        ids[i, : len(bias)] = list(bias)
        values[i, : len(bias)] = list(bias.values())
    return ids, values


def _history(seqs: Sequence[ScheduledSeq], rows: list[int], num_rows: int, history_len: int) -> np.ndarray:
    """[S, L] i32 token history (prompt first), -1 padded; only rows with penalties are filled."""
    longest = max(len(seqs[i].history) for i in rows)
    if history_len == 0:
        history_len = longest
    if history_len < longest:
        raise ValueError(f"history_len={history_len} is shorter than the longest penalty history ({longest} tokens)")
    history = np.full((num_rows, history_len), -1, np.int32)
    for i in rows:
        h = seqs[i].history
        history[i, : len(h)] = h
    return history

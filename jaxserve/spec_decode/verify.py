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
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import buckets, launch_mode
from jaxserve.batch_builder import build_step_inputs
from jaxserve.kv_scale_calibration import with_kv_scales
from jaxserve.model_runner import ModelRunner
from jaxserve.sampler import _with_logprobs
from jaxserve.sampling_metadata import SamplingMetadata
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.spec_decode.rejection import accept
from jaxserve.step_program import (
    dummy_inputs,
    load_or_compile,
    pack_inputs,
    run_model,
    unpack_inputs,
)

logger = logging.getLogger("jaxserve")



def _verify(
    graphdef, treedef, k, forced, aux_layers, states_sharding, pure, params, kv_caches, tok_fields, seq_fields, fed,
    spec_rows, num_spec, kv_scales=None,
):
    """(params, cache, packed batch, fed proposals [S_max, k], spec_rows [4, R], num_spec [S], the runner's traced
    fp8 scales or None) -> (logits [R, V] f32, greedy tokens [S, K+1], greedy num_emitted [S], both packed
    [S, K+2], spec_rows with the proposals as the step read them, the hidden states an EAGLE head reads of each
    sequence's tokens 0..K [S, K+1, W] (None without a head), new cache).

    Where a token's ``prev_index`` is >= 0 its id is ``fed.flat[prev_index]``: a proposal a round fed by the last
    verify step left on the device (spec_decode.fed_rounds), which the host has not read. So the proposal each
    logits row scores (spec_rows[1], -1: none) is taken here from the step's own input ids, the token after the
    row's. The greedy acceptance is computed here, inside the model's program: an all-greedy batch (the common
    case) then needs no second program. Sampled rows and logprobs take ``_accept`` over the logits.
    ``pure`` (static): the program of steps where no sequence has more than 1 + k tokens (no prompt chunk), whose
    attention may then take the decode path alone (AttentionMetadata.decode_query_len)."""
    input_ids, prev_index, attn_md = unpack_inputs(tok_fields, seq_fields, pure, k + 1 if pure else 1)
    input_ids = jnp.where(prev_index >= 0, fed.reshape(-1)[jnp.maximum(prev_index, 0)], input_ids)
    last = input_ids.shape[0] - 1
    scored = jnp.where(spec_rows[1] >= 0, input_ids[jnp.minimum(spec_rows[0] + 1, last)], -1)  # [R]
    spec_rows = spec_rows.at[1].set(scored)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    if kv_scales is not None:  # calculate_kv_scales (jaxserve/kv_scale_calibration.py)
        with_kv_scales(model, kv_scales)
    states = None
    if aux_layers:
        # An EAGLE round fed by this step reads these, not the store that the next verify step donates.
        hidden, kv_caches, aux = run_model(model, input_ids, kv_caches, attn_md, aux_layers, with_aux=True)
        at = jnp.minimum(attn_md.query_start_loc[:-1, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :], last)
        states = aux[at]  # [S, K+1, W]
        if states_sharding is not None:
            states = jax.lax.with_sharding_constraint(states, states_sharding)
    else:
        hidden, kv_caches = run_model(model, input_ids, kv_caches, attn_md)  # [T, E]
    logits = model.compute_logits(hidden[spec_rows[0]])  # [R, V] f32: only the positions that score something
    greedy_md = SamplingMetadata.from_seqs([], spec_rows.shape[1])
    tokens, num_emitted, _ = accept(logits, spec_rows[1:], num_spec, greedy_md, k, forced)
    return logits, tokens, num_emitted, _packed(tokens, num_emitted), spec_rows, states, kv_caches


def _packed(tokens, num_emitted):
    """[S, K+2] i32: the tokens and, last, their count: what the host reads back, in one transfer, not two."""
    return jnp.concatenate([tokens, num_emitted[:, None]], axis=1)


def _accept(k, forced, logits, spec_rows, num_spec, md):
    """The sampled / logprobs acceptance: (tokens [S, K+1], num_emitted [S], packed [S, K+2], logprobs or None)."""
    tokens, num_emitted, emitted = accept(logits, spec_rows[1:], num_spec, md, k, forced)
    lp = _with_logprobs(logits, emitted) if md.needs_logprobs else None
    return tokens, num_emitted, _packed(tokens, num_emitted), lp


@dataclasses.dataclass
class VerifyHandle:
    tokens: jax.Array  # [S, K+1] i32, on the device (a fed proposal round reads them there)
    num_emitted: jax.Array  # [S] i32
    packed: jax.Array  # [S, K+2] i32: tokens, then num_emitted; its copy to the host starts at dispatch
    logprobs: object  # SamplerOutput of the R logits rows, or None
    row_start: np.ndarray  # [S_real]: each sequence's first logits row
    num_rows: int
    num_tokens: int = 0  # T: the step's token bucket
    states: object = None  # [S, K+1, W]: with an EAGLE head, the hidden states of each sequence's tokens


class VerifyRunner:
    """Runs verify steps over a ModelRunner's weights and KV cache, for ``k`` proposals per sequence at most."""

    def __init__(self, runner: ModelRunner, k: int, forced_acceptance_length: int | None = None) -> None:
        self.runner = runner
        self.k = k
        self.forced = forced_acceptance_length
        self.num_loaded_programs = 0  # verify programs the last warmup loaded from the executable store
        states_sharding = None
        if runner.aux_layers:
            from jaxserve.spec_decode.fed_rounds import verify_states_sharding

            states_sharding = verify_states_sharding(runner.kv_caches[-1])
        verify = functools.partial(
            _verify, runner.graphdef, runner._treedef, k, forced_acceptance_length, runner.aux_layers, states_sharding
        )
        # Two programs per shape: steps with prompt chunks in them, and pure verify steps (no sequence has more
        # than 1 + k tokens), whose attention skips the prefill path as a pure decode step's does.
        self._steps = {pure: jax.jit(functools.partial(verify, pure), donate_argnums=1) for pure in (False, True)}
        self._accept = jax.jit(functools.partial(_accept, k, forced_acceptance_length))
        self._programs: dict[tuple[int, int, int, bool], object] = {}  # (T, B, R, pure) -> compiled verify step
        # Launched kernel by kernel on GPUs: a verify step's launch waits for the step before it (launch_mode).
        self._options = launch_mode.compiler_options(runner.runner_config.platform, host_bound=True)
        self.num_lazy_compiles = 0
        # On an accelerator copy_to_host_async only queues the copy; XLA:CPU's waits for the step (measured: 0.06-0.1
        # ms of a CPU step's host time), and its "copy" is a host memcpy anyway.
        self._copy_early = runner.runner_config.platform != "cpu"
        # What the verify program reads where no token is fed from the device (every step without a fed round).
        self._no_fed = jax.device_put(np.zeros((runner.max_rows, k), np.int32), runner._last_tokens.sharding)
        self._min_tokens = buckets.pick(runner.token_buckets, min(k + 1, runner.token_buckets[-1]))
        # Pure verify programs up to the bucket max_num_seqs tokens fill, as the runner's decode variants: speculation
        # pays at low concurrency, and larger pure steps take the general program (correct, a prefill launch more).
        self._most_pure = max(self._min_tokens, buckets.pick(
            runner.token_buckets, min(runner.scheduler_config.max_num_seqs, runner.token_buckets[-1])
        ))

    def dispatch(self, sched: SchedulerOutput, fed: jax.Array | None = None, fed_rows: dict | None = None):
        """Launch the step; without any proposal in it, the runner's own step (its output has one token a row).
        ``fed`` [S_max, k] (on the device) and ``fed_rows`` {sequence index: row of ``fed``}: those sequences'
        proposals are ``fed``'s row, not their (placeholder) token ids (``fed_rounds.FedRound``)."""
        if not any(seq.num_spec_tokens for seq in sched.seqs):
            return self.runner.dispatch(sched)
        r = self.runner
        t, s, b = r._shapes_for(sched)[:3]  # not the runner's decode-only flag: a verify step has its own, `pure`
        pure = all(len(seq.token_ids) <= self.k + 1 for seq in sched.seqs) and t <= self._most_pure
        if t < self._min_tokens:  # proposals cut short (max_tokens): pad to the full program's bucket (CPU only)
            t = self._min_tokens
            s = buckets.seq_bucket_for(t, r.scheduler_config.max_num_seqs)
        x = build_step_inputs(
            sched.seqs, num_tokens_padded=t, num_seqs_padded=s, block_width=b, block_size=r.block_size,
            num_blocks=r.num_blocks,
        )
        if fed_rows:
            if not fed.sharding.is_equivalent_to(self._no_fed.sharding, fed.ndim):
                fed = jax.device_put(fed, self._no_fed.sharding)  # as the program was compiled for (TP: replicated)
            qsl = x.query_start_loc
            for i, row in fed_rows.items():
                n = sched.seqs[i].num_spec_tokens  # its proposals are its last n query tokens
                x.prev_index[qsl[i + 1] - n : qsl[i + 1]] = np.arange(row * self.k, row * self.k + n)
        else:
            fed = self._no_fed
        num_rows = self.rows_for(t)  # >= the rows scored: at most T tokens, at most 1 + k per sequence
        spec_rows, num_spec, counts, row_start = _spec_rows(sched.seqs, x, s, num_rows)
        # A plain greedy batch (the common case) reads no sampling settings: the program decides its acceptance.
        md = None
        if not _plain_greedy(sched.seqs):
            md = _rows_metadata(SamplingMetadata.from_seqs(sched.seqs, s, r._history_len(sched)), counts, num_rows)
            if md.plain_greedy:
                md = None
        args = (*pack_inputs(x), fed, spec_rows, num_spec, r._kv_scales_arr)
        key = (t, b, num_rows, pure)
        program = self._programs.get(key)
        if program is None:
            logger.info("compiling verify step tokens=%d ctx=%d rows=%d pure=%s on first use", t, b * r.block_size,
                        num_rows, pure)
            self.num_lazy_compiles += 1
            lowered = self._steps[pure].lower(r.params, r.kv_caches, *args)
            program = self._programs[key] = lowered.compile(self._options)
        logits, tokens, num_emitted, packed, scored_rows, states, r.kv_caches = program(r.params, r.kv_caches, *args)
        lp = None
        if md is not None:
            tokens, num_emitted, packed, lp = self._accept(logits, scored_rows, num_spec, md)
        if self._copy_early:  # queue the copy to the host behind the step now: it arrives when the step ends
            packed.copy_to_host_async()
        r.num_steps += 1
        return VerifyHandle(tokens, num_emitted, packed, lp, row_start, len(sched.seqs), t, states)

    def rows_for(self, t: int) -> int:
        """Logits rows R of a verify step of T tokens: one per token the step could score (every sequence's
        1 + k), a power of two, at most T. R depends on T alone, so the verify programs are one per (T, B), as
        the runner's; a step scoring fewer rows computes a few more logits than it needs (at T = 16, k = 4: 16
        rows for 5), which a step of T tokens easily affords."""
        s = buckets.seq_bucket_for(t, self.runner.scheduler_config.max_num_seqs)
        return _row_bucket(min(t, s * (self.k + 1)))

    def startup_shapes(self) -> list[tuple[int, int, int, bool]]:
        """(T, B, R, pure) to compile at start-up: the runner's start-up (T, B) with room for a proposal, each also
        as a pure verify step up to the largest bucket one fills ("all", the accelerators' default); "common"
        (CPU, where each compile costs seconds): the single stream's steady state only, one sequence of 1 + k
        tokens at the shortest context, a pure verify step. Others compile on first use."""
        r = self.runner
        policy = r.runner_config.precompile
        if policy == "common":
            return [(self._min_tokens, r.width_buckets[0], self.rows_for(self._min_tokens), True)]
        shapes = [(t, b) for t, b in buckets.startup_shapes(r.token_buckets, r.width_buckets, policy) if t >= 2]
        return [(t, b, self.rows_for(t), pure) for t, b in shapes for pure in (False, True)
                if not pure or t <= self._most_pure]

    def warmup(self) -> float:
        """Compile the start-up verify steps side by side (XLA compiles without the GIL); returns seconds. A
        program stored by an earlier start (accelerators: jaxserve.executable_store, the runner's store) is loaded
        instead of traced, and each one compiled here is stored. The sampled-acceptance programs (small) compile
        on first use."""
        start, r = time.perf_counter(), self.runner

        def lower(shape):
            return self._steps[shape[3]].lower(r.params, r.kv_caches, *self._dummy_args(shape))

        programs, self.num_loaded_programs = load_or_compile(
            r._executable_store(), list(r.mesh.devices.flat), self.startup_shapes(), self._store_name, lower,
            self._options,
        )  # fmt: skip
        self._programs.update(programs)
        if r.runner_config.platform != "cpu":
            self.prime()
        return time.perf_counter() - start

    def _dummy_args(self, shape: tuple[int, int, int, bool]) -> tuple:
        """A padding-only verify step of ``shape`` (T, B, R, pure): no sequence, no proposal, every KV write dropped."""
        t, b, n, _ = shape
        r = self.runner
        s = buckets.seq_bucket_for(t, r.scheduler_config.max_num_seqs)
        x = dummy_inputs(t, s, b, r.num_blocks * r.block_size)
        rows = np.zeros((4, n), np.int32)
        rows[1], rows[2] = -1, s
        return (*pack_inputs(x), self._no_fed, rows, np.zeros(s, np.int32), r._kv_scales_arr)

    def prime(self) -> None:
        """Run every start-up verify program once on padding, largest first (accelerators), as ModelRunner._prime
        does for the plain steps: the first launch of each (kernels loaded, command buffer recorded) then lands
        here and not on the first requests' verify steps. Padding writes no KV."""
        r, logits = self.runner, None
        for shape in sorted(self.startup_shapes(), reverse=True):
            logits, *_, r.kv_caches = self._programs[shape](r.params, r.kv_caches, *self._dummy_args(shape))
        jax.block_until_ready(logits)

    def _store_name(self, shape: tuple[int, int, int, bool]) -> str:
        """A verify program's name in the runner's store: the runner's context keys the model, cache and mesh; the
        name adds what only the verify step has (k, a forced acceptance length, the shape and the pure flag)."""
        t, b, n, pure = shape
        forced = "" if self.forced is None else f"-a{self.forced}"
        tail = ("-pure" if pure else "") + launch_mode.describe(self._options)
        return f"verify-k{self.k}{forced}-t{t}-b{b}-r{n}" + tail

    def fetch(self, handle) -> ModelRunnerOutput:
        """Read a step back: ``emitted_token_ids`` per row (a plain step's one token becomes a list of one)."""
        if not isinstance(handle, VerifyHandle):
            out = self.runner.fetch(handle)
            return dataclasses.replace(out, emitted_token_ids=[[t] for t in out.sampled_token_ids])
        lp = handle.logprobs
        # Without logprobs one array: np.asarray skips device_get's pytree walk.
        packed, lp = (np.asarray(handle.packed), None) if lp is None else jax.device_get((handle.packed, lp))
        rows = handle.num_rows
        emitted = [row[: row[-1]] for row in np.asarray(packed)[:rows].tolist()]  # row[-1]: num_emitted
        out = ModelRunnerOutput(sampled_token_ids=[e[0] for e in emitted], emitted_token_ids=emitted)
        if lp is None:
            return out
        # Logprob lists laid out with a stride of K+1 per sequence (ModelRunnerOutput.logprobs_stride).
        stride = self.k + 1
        where = np.zeros(rows * stride, np.int64)  # entry -> logits row (unused entries read row 0)
        for i, e in enumerate(emitted):
            where[i * stride : i * stride + len(e)] = handle.row_start[i] + np.arange(len(e))

        def cut(a):
            return np.asarray(a)[where].tolist()

        return dataclasses.replace(
            out, sampled_logprobs=cut(lp.sampled_logprobs), sampled_ranks=cut(lp.sampled_ranks),
            top_token_ids=cut(lp.top_token_ids), top_logprobs=cut(lp.top_logprobs), logprobs_stride=stride,
        )


def _spec_rows(seqs, x, s: int, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each sequence's logits rows are: (spec_rows [4, R], num_spec [S], counts [S_real], row_start [S_real]).
    spec_rows: token index in the flat batch | proposal scored there (-1: none) | sequence (S: padding) | position
    j. The four rows are gathered in Python lists and written with one numpy assignment: for the few sequences of
    a speculative batch that is cheaper than numpy's per-call cost, whether per sequence or by columns (a single
    stream: 11 us against 10 per-sequence writes and 28 column-wise, on the dev CPU)."""
    qsl = x.query_start_loc
    tok: list[int] = []
    proposal: list[int] = []
    seq_of_row: list[int] = []
    pos: list[int] = []
    counts: list[int] = []
    for i, seq in enumerate(seqs):
        n = seq.num_spec_tokens
        last = int(qsl[i + 1]) - 1  # the sequence's last query token: its last proposal, or its one token
        tok += range(last - n, last + 1)
        if n:
            proposal += seq.token_ids[len(seq.token_ids) - n :]  # proposals are a sequence's last query tokens
        proposal.append(-1)  # after the last proposal: the bonus row
        seq_of_row += [i] * (n + 1)
        pos += range(n + 1)
        counts.append(n + 1)
    r_real = len(tok)
    spec_rows = np.empty((4, num_rows), np.int32)
    spec_rows[:, :r_real] = (tok, proposal, seq_of_row, pos)
    spec_rows[:, r_real:] = np.array([[0], [-1], [s], [0]], np.int32)  # padding rows belong to no sequence: dropped
    counts_arr = np.array(counts, np.int32)  # [S_real] logits rows per sequence
    num_spec = np.zeros(s, np.int32)  # [S]
    num_spec[: len(counts)] = counts_arr - 1
    return spec_rows, num_spec, counts_arr, np.cumsum(counts_arr, dtype=np.int32) - counts_arr


def _plain_greedy(seqs) -> bool:
    """Whether every row surely takes the bare argmax (SamplingMetadata.plain_greedy) without building the
    metadata: greedy, no penalties, no logprobs, no min_tokens (whose bans depend on the row), no logit_bias, no
    token mask. A False may still turn out plain once the metadata is built."""
    distinct = {id(seq.sampling_params): seq.sampling_params for seq in seqs}.values()  # often one
    return all(sp.greedy and not sp.uses_penalties and sp.logprobs is None and not sp.min_tokens and not sp.logit_bias
               and not sp.uses_token_mask for sp in distinct)  # fmt: skip


def _row_bucket(n: int) -> int:
    """Logits rows, padded to a power of two."""
    return 1 << max(0, (n - 1).bit_length())


def _rows_metadata(md: SamplingMetadata, counts: np.ndarray, num_rows: int) -> SamplingMetadata:
    """Each sequence's row repeated for its ``counts`` logits rows (position j's step + j), padded to ``num_rows``
    with copies of row S-1 (padding rows' outputs are dropped)."""
    seq_of_row = np.repeat(np.arange(len(counts)), counts)  # [R_real]
    pos_of_row = np.arange(len(seq_of_row)) - np.repeat(np.cumsum(counts) - counts, counts)  # [R_real]
    pad = num_rows - len(seq_of_row)
    index = np.concatenate([seq_of_row, np.full(pad, md.num_rows - 1)])  # [R]
    fields = {}
    for f in dataclasses.fields(md):
        value = getattr(md, f.name)
        if isinstance(value, np.ndarray):
            fields[f.name] = value[index]
    fields["steps"] = fields["steps"] + np.concatenate([pos_of_row, np.zeros(pad, np.int64)]).astype(np.int32)
    return dataclasses.replace(md, **fields)

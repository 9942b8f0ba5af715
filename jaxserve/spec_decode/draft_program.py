"""One jitted program per draft round: the catch-up chunk, then k - 1 greedy decode steps, all on the device.

A draft round used to be k host round-trips through the draft's ModelRunner (build the batch, dispatch, and
for the first step read back). Here the catch-up batch (each request's tokens from its valid length to its
last known token: usually the 1..k+1 tokens accepted last round) runs as an ordinary ragged step whose argmax
is proposal 0; then k - 1 one-token decode steps follow inside the same program, each feeding the previous
step's argmax at the next position. Their positions, slots and context lengths are computed on the device
from the catch-up's per-sequence ``seq_lens`` and block tables, so the host builds one batch and reads back
one [S, k] array per round.

The decode steps are unrolled (a Python loop, k is static) by default: on GPU, XLA captures an unrolled
program's kernels into command buffers, not those of a while loop's body. ``JAXSERVE_DRAFT_LOOP=fori``
compiles a ``lax.fori_loop`` instead (a smaller program that compiles faster; measure both).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import launch_mode
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.sampler import argmax
from jaxserve.step_program import load_or_compile, unpack_inputs


def unrolled() -> bool:
    value = os.environ.get("JAXSERVE_DRAFT_LOOP", "unroll")
    if value not in ("unroll", "fori"):
        raise ValueError(f"JAXSERVE_DRAFT_LOOP={value!r} is not one of 'unroll', 'fori'")
    return value == "unroll"


def decode_metadata(md: AttentionMetadata, offset: jax.Array, block_size: int, num_slots: int) -> AttentionMetadata:
    """One decode token per real sequence at position ``seq_lens + offset`` (``md`` is the catch-up's; its real
    sequences come first and have seq_lens > 0). Padding sequences get an empty query range, their token a
    dropped KV write, as AttentionMetadata's padding rules ask. T = S."""
    s = md.seq_lens.shape[0]
    real = md.seq_lens > 0  # [S]
    num_real = real.sum()
    rows = jnp.arange(s, dtype=jnp.int32)  # [S]
    pos = jnp.where(real, md.seq_lens + offset, 0)  # [S]
    block = jnp.take_along_axis(md.block_tables, (pos // block_size)[:, None], axis=1)[:, 0]  # [S]
    return AttentionMetadata(
        positions=pos,
        slot_mapping=jnp.where(real, block * block_size + pos % block_size, num_slots),
        token_seq_ids=jnp.where(real, rows, s - 1),
        query_start_loc=jnp.minimum(jnp.arange(s + 1, dtype=jnp.int32), num_real),
        seq_lens=jnp.where(real, pos + 1, 0),
        block_tables=md.block_tables,
        logits_indices=rows,
        decode_only=True,
    )


def propose(graphdef, treedef, k: int, block_size: int, num_slots: int, unroll: bool, params, kv_caches, tok, seq):
    """(params, draft cache [donated], packed catch-up batch) -> (proposals [S, k] i32, new cache).

    The catch-up batch's block tables must already cover positions up to seq_lens + k - 2 (the decode steps
    write there)."""
    input_ids, _, md = unpack_inputs(tok, seq)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    return draft_round(model, kv_caches, input_ids, md, k, block_size, num_slots, unroll)


def draft_round(model, kv_caches, input_ids, md: AttentionMetadata, k: int, block_size: int, num_slots: int,
                unroll: bool):
    """The catch-up (input_ids [T] over ``md``), whose argmax at each sequence's last token is proposal 0, then
    k - 1 decode steps. -> (proposals [S, k] i32, new cache)."""
    hidden, kv_caches = model(input_ids, kv_caches, md)  # [T, E]
    first = argmax(model.compute_logits(hidden[md.logits_indices]))  # [S]: proposal 0
    out = jnp.zeros((first.shape[0], k), jnp.int32).at[:, 0].set(first)  # [S, k]

    def step(j, carry):
        # Feed proposal j - 1 at position N + j - 1; its argmax is proposal j.
        out, kv = carry
        dmd = decode_metadata(md, j - 1, block_size, num_slots)
        ids = jax.lax.dynamic_index_in_dim(out, j - 1, axis=1, keepdims=False)  # [S]
        h, kv = model(ids, kv, dmd)
        nxt = argmax(model.compute_logits(h))  # [S]
        return jax.lax.dynamic_update_index_in_dim(out, nxt, j, axis=1), kv

    if k > 1:
        if unroll:
            carry = (out, kv_caches)
            for j in range(1, k):
                carry = step(j, carry)
            out, kv_caches = carry
        else:
            out, kv_caches = jax.lax.fori_loop(1, k, step, (out, kv_caches))
    return out, kv_caches


def round_inputs(seqs, ends: list[int], block_ids: list[list[int]], runner, max_seqs: int):
    """A round's catch-up batch, padded to ``runner``'s buckets, with block tables wide enough for the decode
    steps too: sequence i writes positions up to ``ends[i] - 1``. -> StepInputs."""
    from jaxserve import buckets
    from jaxserve.batch_builder import build_step_inputs

    t = buckets.pick(runner.token_buckets, sum(len(s.token_ids) for s in seqs))
    s = buckets.seq_bucket_for(t, max_seqs)
    b = buckets.pick(runner.width_buckets, -(-max(ends) // runner.block_size))
    x = build_step_inputs(seqs, num_tokens_padded=t, num_seqs_padded=s, block_width=b,
                          block_size=runner.block_size, num_blocks=runner.num_blocks)
    for i, (blocks, end) in enumerate(zip(block_ids, ends)):
        n = -(-end // runner.block_size)
        x.block_tables[i, :n] = blocks[:n]
    return x


class RoundPrograms:
    """Compiled round programs, one per catch-up shape (T, B) of ``runner``'s buckets; the start-up shapes compile
    with the rest (``warmup``). A subclass says what comes before the batch (``_lead``) and where the returned
    cache goes (``_keep``)."""

    name = "proposal"
    store_prefix = "proposal"  # the programs' names in the executable store start with this
    # Whether a round's launch waits on the host (launch_mode): a draft model's rounds launch while the verify
    # step before them runs (fed rounds) or are ~800 kernels the host issues slower than the device runs them;
    # an EAGLE head's are a few dozen, launched after the host read the step (subclasses say).
    host_bound = False

    def __init__(self, runner, k: int, jitted) -> None:
        self.runner = runner  # whose buckets (and, for a draft model, weights and cache) the rounds use
        self.k = k
        self._jit = jitted  # (*lead, tok [5, T], seq [S, 3 + B]) -> (proposals [S, k], cache)
        self._programs: dict[tuple[int, int], object] = {}  # (T, B) -> compiled program
        self.num_lazy_compiles = 0
        self.num_loaded_programs = 0  # programs the last warmup loaded from the executable store
        self.loop = "unroll" if unrolled() else "fori"  # as the subclass's jitted function was built, just before
        self._options = launch_mode.compiler_options(runner.runner_config.platform, self.host_bound)

    def _lead(self) -> tuple:
        raise NotImplementedError

    def _keep(self, cache) -> None:
        raise NotImplementedError

    def shapes(self) -> list[tuple[int, int]]:
        from jaxserve import buckets

        r = self.runner
        return buckets.startup_shapes(r.token_buckets, r.width_buckets, r.runner_config.precompile)

    def _lower(self, shape: tuple[int, int], args: tuple):
        return self._jit.lower(*args)

    def _key(self, x) -> tuple[int, int]:
        """The program a call's inputs need: (T, B) of a StepInputs."""
        return x.input_ids.shape[0], x.block_tables.shape[1]

    def _args(self, shape: tuple[int, int], x=None) -> tuple:
        """The arguments after ``_lead``: the packed batch ``x``, or a padding-only one of ``shape``."""
        from jaxserve import buckets
        from jaxserve.step_program import dummy_inputs, pack_inputs

        if x is None:
            r = self.runner
            t, b = shape
            x = dummy_inputs(t, buckets.seq_bucket_for(t, r.scheduler_config.max_num_seqs), b,
                              r.num_blocks * r.block_size)
        return pack_inputs(x)

    def warmup(self) -> float:
        """Compile the start-up shapes side by side (XLA compiles without the GIL); returns seconds. A program
        stored by an earlier start (accelerators: jaxserve.executable_store) is loaded instead of traced, and each
        one compiled here is stored."""
        import time

        start = time.perf_counter()
        programs, self.num_loaded_programs = load_or_compile(
            self._store(), list(self.runner.mesh.devices.flat), self.shapes(), self._store_name,
            lambda shape: self._lower(shape, (*self._lead(), *self._args(shape))), self._options,
        )  # fmt: skip
        self._programs.update(programs)
        if self.runner.runner_config.platform != "cpu":
            self.prime()
        return time.perf_counter() - start

    def prime(self) -> None:
        """Run every start-up round program once on padding, largest first (accelerators; on CPU a large dummy
        round costs real seconds), as ModelRunner._prime does for the steps: a program's first launch loads its
        kernels and records its command buffer, which would otherwise land on the first requests' rounds.
        Padding sequences write no KV (their slots are dropped); the runner's step count is left as it was."""
        steps, out = self.runner.num_steps, None
        for key in sorted(self.shapes(), reverse=True):
            out, cache = self._programs[key](*self._lead(), *self._args(key))
            self._keep(cache)
        jax.block_until_ready(out)
        self.runner.num_steps = steps

    def _store(self):
        """Where the round programs persist between starts: the runner's executable store (None on CPU), whose
        context keys the model, dtype, KV cache (blocks, dtype, scales), buckets and mesh they run over; a
        subclass whose programs read more (an EAGLE head) adds it to that context."""
        return self.runner._executable_store()

    def _store_name(self, shape: tuple[int, int]) -> str:
        """A round program's name in the store: what the runner's context does not say (k, the decode loop's
        form, the shape). A forced acceptance length changes the verify step only, not the rounds."""
        t, b = shape
        return f"{self.store_prefix}-k{self.k}-{self.loop}-t{t}-b{b}" + launch_mode.describe(self._options)

    def __call__(self, x) -> jax.Array:
        """Run one round on ``x`` (what ``_args`` takes); returns proposals [S, k] on the device."""
        import logging

        key = self._key(x)
        args = (*self._lead(), *self._args(key, x))
        program = self._programs.get(key)
        if program is None:
            logging.getLogger("jaxserve").info("compiling %s program %s on first use", self.name, key)
            self.num_lazy_compiles += 1
            program = self._programs[key] = self._lower(key, args).compile(self._options)
        proposals, cache = program(*args)
        self._keep(cache)
        return proposals


class DraftPrograms(RoundPrograms):
    """The draft model's rounds, over its ModelRunner's weights and cache (donated in, handed back)."""

    name = "draft proposal"
    store_prefix = "draft"

    def __init__(self, runner, k: int) -> None:
        import functools

        num_slots = runner.num_blocks * runner.block_size
        fn = functools.partial(propose, runner.graphdef, runner._treedef, k, runner.block_size, num_slots, unrolled())
        super().__init__(runner, k, jax.jit(fn, donate_argnums=1))

    def _lead(self) -> tuple:
        return self.runner.params, self.runner.kv_caches

    def _keep(self, cache) -> None:
        self.runner.kv_caches = cache
        self.runner.num_steps += 1

"""Proposal rounds fed on the device by the verify step, dispatched right behind it.

In the steady state (every sequence of a verify step had proposals from the proposer's last round, and its
cache is as that round left it), the next round's catch-up is a fixed function of what the verify step emits:
- EAGLE: the pairs (emitted token j, target hidden state at position N - 1 + j) for j < num_emitted (the
  round's proposal-fed positions never stay valid);
- a draft model: the emitted tokens j = m .. num_emitted - 1 at positions N + j, where m = min(num_emitted - 1,
  num_fed) is how many of the proposals it fed (and still holds the KV of) were accepted.
So the round need not wait for the host: the engine dispatches it right after the verify step, with the
verify step's token arrays (still on the device) as its input, and reads the proposals back only after it has
applied the verify step's tokens (stops, detokenizing, outputs): that host work overlaps the round's device
time, and the round's own dispatch overlaps the verify step's. The catch-up batch is laid out on the device
(``fed_metadata``); what the host knows in advance (each sequence's position N - 1 and a block table wide
enough for any acceptance) travels as ordinary inputs.

Whatever the host then finds (a request finished, or was cut short), proposals it cannot use are dropped and
that request takes the ordinary round from its recorded state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.spec_decode.draft_program import RoundPrograms, draft_round, unrolled


def fed_metadata(first, num_emitted, base, block_tables, block_size: int, num_slots: int, width: int, t: int):
    """The catch-up's ragged layout from the verify step's output: sequence s runs its emitted tokens
    j = first[s] .. num_emitted[s] - 1 at positions base[s] + j (base[s] < 0: padding, no tokens); T = ``t``
    tokens (the verify step's bucket: it emitted no more), padding last. -> (index [T]: the (s, j) each token
    reads, flat s * width + j; AttentionMetadata)."""
    s = base.shape[0]
    real = base >= 0  # [S]
    count = jnp.where(real, num_emitted - first, 0)  # [S]
    qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(count).astype(jnp.int32)])  # [S+1]
    f = jnp.arange(t, dtype=jnp.int32)  # [T]
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], f, side="right").astype(jnp.int32), s - 1)  # [T]
    j = first[seq] + f - qsl[seq]  # [T]
    real_tok = f < qsl[-1]  # [T]
    pos = jnp.where(real_tok, base[seq] + j, 0)  # [T]
    block = jnp.take_along_axis(block_tables[seq], (pos // block_size)[:, None], axis=1)[:, 0]  # [T]
    md = AttentionMetadata(
        positions=pos,
        slot_mapping=jnp.where(real_tok, block * block_size + pos % block_size, num_slots),
        token_seq_ids=jnp.where(real_tok, seq, s - 1),
        query_start_loc=qsl,
        seq_lens=jnp.where(real, base + num_emitted, 0),
        block_tables=block_tables,
        logits_indices=jnp.maximum(qsl[1:] - 1, 0),
    )
    return jnp.where(real_tok, seq * width + j, 0), md


def _fed_inputs(tokens, num_emitted, start, block_tables, first, offset, block_size, num_slots, t):
    """(ids [T], index [T], md) of a fed catch-up; ``offset``: the position of emitted token 0 minus N - 1 (EAGLE
    0: a pair at N - 1 + j; draft 1: token j at N + j); ``index``: the flat (s, j) each token reads."""
    base = jnp.where(start >= 0, start + offset, -1)  # [S]
    index, md = fed_metadata(first, num_emitted, base, block_tables, block_size, num_slots, tokens.shape[1], t)
    return tokens.reshape(-1)[index], index, md  # [T]


def _padded(rows: int, proposals, cache):
    """Proposals [S, k] padded to [rows, k]: one shape for every verify program that reads them (VerifyRunner)."""
    return jnp.pad(proposals, ((0, rows - proposals.shape[0]), (0, 0))), cache


def propose_fed_eagle(
    tgraph, ttree, hgraph, htree, k, block_size, num_slots, unroll, rows,
    target_params, head_params, head_kv, d2t, tokens, num_emitted, start, num_fed, block_tables, states, *,
    num_tokens,
):  # fmt: skip
    """(target params, head params, head cache [donated], d2t, the verify step's tokens [S, K+1] and num_emitted
    [S] (on the device), start [S] i32 (N - 1, or -1 for padding), num_fed [S] (unused here), block tables
    [S, B], the verify step's hidden states of its tokens [S, K+1, W]; ``num_tokens`` (static): T of the
    catch-up) -> (proposals [rows, k] i32 (S real, then padding), new head cache).

    The pair at N - 1 + j takes the hidden state of the verify step's token j, as the verify step handed it over
    (``VerifyHandle.states``), not from the store: the next verify step donates the store, and a round still
    reading it would hold that step's launch until the round ends."""
    from jaxserve.spec_decode.eagle import eagle_round

    first = jnp.zeros_like(num_emitted)
    ids, index, md = _fed_inputs(tokens, num_emitted, start, block_tables, first, 0, block_size, num_slots,
                                 num_tokens)
    hidden = states.reshape(-1, states.shape[-1])[index]  # [T, W]: padding tokens read row 0 (dropped)
    target = nnx.merge(tgraph, jax.tree.unflatten(ttree, target_params))
    head = nnx.merge(hgraph, jax.tree.unflatten(htree, head_params))
    return _padded(rows, *eagle_round(target, head, head_kv, hidden, d2t, ids, md, k, block_size, num_slots, unroll))


def propose_fed_draft(graphdef, treedef, k, block_size, num_slots, unroll, rows, params, kv_caches, tokens,
                      num_emitted, start, num_fed, block_tables, *, num_tokens):
    """As ``propose_fed_eagle``, for a draft model: (params, draft cache [donated], ..., num_fed [S]: proposals
    whose KV the draft cache holds at N.., ...) -> (proposals [rows, k], cache)."""
    first = jnp.minimum(num_emitted - 1, num_fed)  # accepted proposals whose KV the last round wrote
    ids, _, md = _fed_inputs(tokens, num_emitted, start, block_tables, first, 1, block_size, num_slots, num_tokens)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    return _padded(rows, *draft_round(model, kv_caches, ids, md, k, block_size, num_slots, unroll))


def verify_states_sharding(store: jax.Array):
    """Where a verify step puts the hidden states of its tokens [S, K+1, W] for an EAGLE fed round: split by W
    as the store [num_slots, W] is (tensor parallelism), so both programs agree on one layout."""
    from jax.sharding import NamedSharding, PartitionSpec

    sh = store.sharding
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, PartitionSpec(None, None, *tuple(sh.spec)[1:2]))
    return None  # one device: nothing to agree on


class FedPrograms(RoundPrograms):
    """One compiled fed round per (S, B) of the verify steps (S: their sequence bucket), over ``rounds``' weights
    and cache (the proposer's ordinary RoundPrograms). Its proposals come padded to [max_rows, k], the shape the
    verify programs read them in."""

    name = "fed proposal"

    def __init__(self, rounds: RoundPrograms, k: int) -> None:
        r = rounds.runner
        self.rounds = rounds
        self.store_prefix = rounds.store_prefix + "-fed"  # in the store beside the rounds' own programs
        self.host_bound = rounds.host_bound  # launched as the rounds' are (launch_mode)
        num_slots = r.num_blocks * r.block_size
        self.rows = r.max_rows
        self.eagle = hasattr(rounds, "head_graph")
        if self.eagle:  # EaglePrograms: the target runner's weights and the head's
            fn = functools.partial(
                propose_fed_eagle, r.graphdef, r._treedef, rounds.head_graph, rounds.head_tree, k, r.block_size,
                num_slots, unrolled(), self.rows,
            )  # fmt: skip
            donate = 2
        else:  # DraftPrograms: the draft runner's weights and cache
            fn = functools.partial(
                propose_fed_draft, r.graphdef, r._treedef, k, r.block_size, num_slots, unrolled(), self.rows
            )
            donate = 1
        out = {"out_shardings": rounds.out_shardings} if hasattr(rounds, "out_shardings") else {}  # EAGLE's
        super().__init__(r, k, jax.jit(fn, donate_argnums=donate, static_argnames="num_tokens", **out))

    def _lead(self) -> tuple:
        lead = self.rounds._lead()
        if self.eagle:  # (target params, head params, head cache, d2t): not the store (propose_fed_eagle)
            return (*lead[:3], lead[4])
        return lead

    def _keep(self, cache) -> None:
        self.rounds._keep(cache)

    def _store(self):
        return self.rounds._store()  # the same weights and cache as the rounds': the same store context

    def shapes(self) -> list[tuple[int, int]]:
        return [(t, b) for t, b in super().shapes() if t >= 2]  # (T, B) of the verify steps

    def _lower(self, shape: tuple[int, int], args: tuple):
        return self._jit.lower(*args, num_tokens=shape[0])

    def _key(self, x) -> tuple[int, int]:
        return x[0], x[5].shape[1]  # x: (T of the verify step, its inputs...)

    def _args(self, shape: tuple[int, int], x=None) -> tuple:
        from jaxserve import buckets

        if x is not None:
            return x[1:]
        t, b = shape
        s = buckets.seq_bucket_for(t, self.runner.scheduler_config.max_num_seqs)
        # Padding only: tokens [S, K+1], num_emitted [S], start [S] = -1, num_fed [S], block tables [S, B]; for
        # EAGLE the verify step's hidden states [S, K+1, W], as the verify program lays them out.
        args = (np.zeros((s, self.k + 1), np.int32), np.ones(s, np.int32), np.full(s, -1, np.int32),
                np.zeros(s, np.int32), np.zeros((s, b), np.int32))
        if self.eagle:
            store = self.runner.kv_caches[-1]
            states = np.zeros((s, self.k + 1, store.shape[1]), store.dtype)
            args += (jax.device_put(states, verify_states_sharding(store)),)
        return args


def fed_block_tables(sched, kv, runner, k: int, s: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Each sequence's N - 1 ([S], -1 for padding) and a block table [S, B] wide enough for the round after any
    acceptance: positions below num_computed (N + k', as if all were accepted) + k - 1, allocated here. Those
    past the accepted tokens come back with the rejected proposals' slots (free_tail), possibly to another
    request: a draft model then checks that it got its blocks back (``_record_fed``). None if some request has
    no room."""
    from jaxserve import buckets

    last_position = runner.max_blocks_per_seq * runner.block_size - 1
    for r in sched.requests:
        if r.num_computed_tokens + k - 1 > last_position or not kv.allocate_slots(r, k):
            return None
    ends = [r.num_computed_tokens + k for r in sched.requests]
    width = buckets.pick(runner.width_buckets, -(-max(ends) // runner.block_size))
    start = np.full(s, -1, np.int32)
    tables = np.zeros((s, width), np.int32)
    for i, (seq, r, end) in enumerate(zip(sched.seqs, sched.requests, ends)):
        start[i] = seq.start_pos
        n = -(-end // runner.block_size)
        tables[i, :n] = kv.get_block_ids(r)[:n]
    return start, tables


@dataclasses.dataclass
class FedRound:
    """A fed round in flight, and then (``claim_fed``) the requests whose next verify step reads its proposals on
    the device."""

    proposals: jax.Array  # [max_rows, k] i32 on the device
    request_ids: list[str]  # row i's request
    num_preemptions: list[int]  # row i's request's count at dispatch
    start: list[int]  # row i's N - 1 at dispatch
    blocks: list[list[int]]  # row i's block ids the round wrote through (a copy)
    # request id -> (row, the request, the placeholder list its spec_token_ids got): filled by claim_fed
    claimed: dict = dataclasses.field(default_factory=dict)


class FedRoundsMixin:
    """``dispatch_fed`` / ``claim_fed`` / ``resolve_fed`` for a proposer with ``programs`` (its RoundPrograms),
    ``fed`` (FedPrograms), ``_steady(seq, request)`` (its cache is as the last round left it, for these
    proposals), ``_num_fed(request)`` (proposals whose KV its cache holds), ``_record_fed(request, blocks, kv)``
    (record the state, the proposals' values to come; False: no room for them) and ``_fill_fed(request,
    proposals)`` (their values, once read)."""

    # Whether the next verify step may read the fed round's proposals on the device (``claim_fed``), i.e. be
    # launched while the round runs. A proposer whose fed round read an array that step donates would have to say
    # False: the launch would wait for the round on the host. (An EAGLE round takes the hidden states it needs
    # from the verify step, ``VerifyHandle.states``, not from the store the next one donates.)
    device_fed_verify = True

    def dispatch_fed(self, sched, handle, kv) -> FedRound | None:
        """Right after a verify step: the next round on its tokens, if every sequence is in the steady state."""
        from jaxserve.spec_decode.verify import VerifyHandle

        if not isinstance(handle, VerifyHandle) or not all(seq.num_spec_tokens for seq in sched.seqs):
            return None
        if not all(self._steady(seq, r) for seq, r in zip(sched.seqs, sched.requests)):
            return None
        placed = fed_block_tables(sched, kv, self.programs.runner, self.fed.k, handle.tokens.shape[0])
        if placed is None:
            return None
        start, tables = placed
        num_fed = np.zeros(len(start), np.int32)
        num_fed[: len(sched.seqs)] = [self._num_fed(r) for r in sched.requests]
        t = handle.num_tokens
        proposals = self.fed((t, handle.tokens, handle.num_emitted, start, num_fed, tables, *self._fed_extra(handle)))
        if self.programs.runner.runner_config.platform != "cpu":
            proposals.copy_to_host_async()  # queued behind the round: resolve_fed's read finds it there
        return FedRound(proposals, [r.request_id for r in sched.requests],
                        [r.num_preemptions for r in sched.requests], start[: len(sched.seqs)].tolist(),
                        [list(kv.get_block_ids(r)) for r in sched.requests])

    def _fed_extra(self, handle) -> tuple:
        """What a fed round takes from the verify step besides its tokens (EAGLE: the hidden states)."""
        return ()

    def claim_fed(self, fed: FedRound, requests: list, emitted: list[int], kv) -> list:
        """Give the requests the fed round's proposals where they hold (the request kept every token the verify
        step emitted, ``emitted[i]`` for row i, which the round caught up), without reading them: each such
        request's ``spec_token_ids`` becomes k placeholders, and the next verify step reads the proposals on the
        device (``fed.claimed``; ``resolve_fed`` fills the values in afterwards). Returns the requests still
        without proposals."""
        rows = {rid: i for i, rid in enumerate(fed.request_ids)}
        rest = []
        for r in requests:
            i = rows.get(r.request_id)
            if (i is None or r.num_preemptions != fed.num_preemptions[i]
                    or r.num_tokens != fed.start[i] + 1 + emitted[i]
                    or not self._record_fed(r, fed.blocks[i], kv)):
                rest.append(r)
                continue
            r.spec_token_ids = [0] * self.fed.k
            fed.claimed[r.request_id] = (i, r, r.spec_token_ids)
        return rest

    def resolve_fed(self, fed: FedRound, seqs: dict) -> None:
        """Read the claimed proposals back and put their values where the host keeps them: the proposer's state,
        a request's ``spec_token_ids`` if it still holds the placeholders (not scheduled: a step takes them), and
        the token ids of ``seqs`` ({request id: ScheduledSeq} that verified them on the device)."""
        if not fed.claimed:
            return
        proposals = np.asarray(fed.proposals)[: len(fed.request_ids)].tolist()  # the rows past them are padding
        for rid, (i, r, placeholders) in fed.claimed.items():
            values = proposals[i]
            self._fill_fed(r, values)
            if r.spec_token_ids is placeholders:
                r.spec_token_ids = values
            seq = seqs.get(rid)
            if seq is not None and seq.num_spec_tokens:
                n = seq.num_spec_tokens
                seq.token_ids[len(seq.token_ids) - n :] = values[:n]

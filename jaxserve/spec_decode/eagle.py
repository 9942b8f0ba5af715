"""EAGLE proposals (``method`` "eagle" / "eagle3"): a one-layer head over the target's own hidden states.

Where the hidden states come from: with an EAGLE head the target's steps (plain and verify) also write, for
each token, the hidden states the head reads (EAGLE-1: the final normed output; EAGLE-3: three layers'
inputs, concatenated) into a store [num_slots, W] at the token's KV slot (``ModelRunner(aux_hidden=...)``).
So the store follows the KV cache: whatever position the target has computed, through any step or a shared
prefix-cache block, has its hidden state at its slot, and a rejected proposal's row is as stale as its KV.

The head's own KV cache (one layer) also lives at the target's slots, through the target's block tables, as
the draft model's does. Its position i holds the pair (token i + 1, hidden state of position i). Per request,
positions below ``valid`` hold pairs of real tokens with the target's hidden states. A round (one jitted
program, ``propose_eagle``) catches up positions ``valid`` .. N - 2 (N = the request's tokens: the last pair
is (token N - 1, target hidden N - 2), whose output gives proposal 0), then runs k - 1 decode steps, each
feeding (proposal j - 1, the head's previous output) at position N - 2 + j. Those pairs hold the head's
guesses, not the target's hidden states, so after the round ``valid`` = N - 1 whatever is accepted: the next
round's catch-up is the accepted tokens plus the bonus (1..k+1 pairs). A preempted request starts from 0.

Tensor parallelism: the head is sharded as one more decoder layer of the target (``EaglePrograms`` says why), and
the store is split by its width W over the mesh's ``model`` axis (jaxserve.sharding's ``store_width``).

Prefix-cache sharing: a request that shares another's blocks writes the same head KV into them (the same pairs),
except at the last position of the last shared block when the two diverge right after it (the pair holds the
next token): there the later writer's pair wins. Only proposals can suffer from that, never the output.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.step_program import unpack_inputs
from jaxserve.request import Request
from jaxserve.spec_decode.draft_model import _seq
from jaxserve.spec_decode.draft_program import RoundPrograms, decode_metadata, round_inputs, unrolled
from jaxserve.spec_decode.fed_rounds import FedPrograms, FedRoundsMixin

logger = logging.getLogger("jaxserve")


def propose_eagle(
    tgraph, ttree, hgraph, htree, k, block_size, num_slots, unroll,
    target_params, head_params, head_kv, store, d2t, tok, seq,
):  # fmt: skip
    """(target params, head params, head cache [donated], the target's hidden store [num_slots, W], d2t, packed
    catch-up batch of pairs) -> (proposals [S, k] i32, new head cache)."""
    ids, _, md = unpack_inputs(tok, seq)
    target = nnx.merge(tgraph, jax.tree.unflatten(ttree, target_params))
    head = nnx.merge(hgraph, jax.tree.unflatten(htree, head_params))
    states = jnp.take(store, md.slot_mapping, axis=0, mode="fill", fill_value=0)  # [T, W]
    return eagle_round(target, head, head_kv, states, d2t, ids, md, k, block_size, num_slots, unroll)


def eagle_round(target, head, head_kv, states, d2t, ids, md, k, block_size, num_slots, unroll):
    """The catch-up over the pairs (ids [T]: token i + 1 at position i; states [T, W]: the target's hidden
    states of position i, from the store or from the verify step that computed them), then k - 1 decode steps.
    -> (proposals [S, k] i32, new head cache)."""
    embed = target.model.embed_tokens
    hidden = head.project(states)  # [T, D]
    x, kv = head(embed(ids), hidden, head_kv[0], md)  # [T, D]
    last = x[md.logits_indices]  # [S, D]
    out = jnp.zeros((last.shape[0], k), jnp.int32).at[:, 0].set(head.next_tokens(last, target, d2t))  # [S, k]

    def step(j, carry):
        out, prev, kv = carry
        dmd = decode_metadata(md, j - 1, block_size, num_slots)
        ids = jax.lax.dynamic_index_in_dim(out, j - 1, axis=1, keepdims=False)  # [S]
        x, kv = head(embed(ids), prev, kv, dmd)  # [S, D]
        nxt = head.next_tokens(x, target, d2t)
        return jax.lax.dynamic_update_index_in_dim(out, nxt, j, axis=1), x, kv

    carry = (out, last, kv)
    if k > 1:
        if unroll:
            for j in range(1, k):
                carry = step(j, carry)
        else:
            carry = jax.lax.fori_loop(1, k, step, carry)
    return carry[0], [carry[2]]


class EaglePrograms(RoundPrograms):
    name = "EAGLE proposal"
    store_prefix = "eagle"
    host_bound = True  # a few dozen kernels, launched after the host read the verify step (launch_mode)

    def __init__(self, target_runner, head, d2t: np.ndarray, kv_caches, k: int) -> None:
        from jaxserve import sharding

        r = target_runner
        # Under tensor parallelism the head is sharded by the target's rules table, not replicated (small as it
        # is): it is one more decoder layer of the target's shapes, so the same rules and the same per-device
        # attention (a kernel backend's shard_map, EagleProposer.build) apply unchanged, and its KV cache splits
        # by KV heads as the target's does and as the runner's memory budget counts it. Its fc and EAGLE-3's
        # lm_head map to no mesh axis: replicated. XLA adds the collectives (after o_proj and down_proj, and
        # around fc's read of the width-split hidden-state store).
        self.head_config = (repr(head.config), head.version)  # keys its programs in the store (_store)
        self.head_graph, head_state = nnx.split(head)
        head_state = jax.device_put(head_state, sharding.param_shardings(head, r.mesh))  # no-op once load_head placed it
        self.head_params, self.head_tree = jax.tree.flatten(head_state)
        self.kv_caches = kv_caches  # [(k_pages, v_pages)]: the head's one layer
        self.d2t = jax.device_put(np.asarray(d2t, np.int32), sharding.replicated(r.mesh))  # [V_draft]
        fn = functools.partial(
            propose_eagle, r.graphdef, r._treedef, self.head_graph, self.head_tree, k, r.block_size,
            r.num_blocks * r.block_size, unrolled(),
        )  # fmt: skip
        # (proposals [S, k], the head's cache): the cache comes back in the layout it went in with, which the
        # compiled programs were lowered for (XLA's own choice drops the spec's trailing None: equivalent, but
        # stated here so that no partitioner change can hand the next call another layout).
        self.out_shardings = (sharding.replicated(r.mesh), [(kv_caches[0][0].sharding,) * 2])
        super().__init__(target_runner, k, jax.jit(fn, donate_argnums=2, out_shardings=self.out_shardings))

    def _lead(self) -> tuple:
        r = self.runner
        return r.params, self.head_params, self.kv_caches, r.kv_caches[-1], self.d2t

    def _keep(self, cache) -> None:
        self.kv_caches = cache

    def _store(self):
        """The target runner's store (its weights, cache and the hidden-state store it writes), in a context that
        adds what only the rounds read: the head (its config, version, weights' shapes, dtypes and shardings), its
        KV cache, the hidden-state store and d2t."""

        def arrays(xs):
            return [(x.shape, str(x.dtype), repr(getattr(x.sharding, "spec", x.sharding))) for x in xs]

        context = {
            "head": self.head_config, "params": arrays(self.head_params),
            "tree": str(self.head_tree), "kv": arrays(jax.tree.leaves(self.kv_caches)),
            "hidden_store": arrays([self.runner.kv_caches[-1]]), "d2t": arrays([self.d2t]),
        }
        return self.runner._executable_store(extra={"eagle": context})


@dataclasses.dataclass
class _HeadState:
    num_preemptions: int  # the request's count when recorded: a preemption frees the blocks
    valid: int  # positions [0, valid) of the head's cache hold pairs of real tokens and target hidden states


class EagleProposer(FedRoundsMixin):
    def __init__(self, programs: EaglePrograms, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.programs = programs
        self.fed = FedPrograms(programs, programs.k)  # rounds fed by the verify step on the device
        self.budget = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self._states: dict[str, _HeadState] = {}

    @staticmethod
    def aux_hidden(config, target_text_config, itemsize: int) -> tuple[tuple[int, ...], int, int]:
        """What the target's runner must know of this head: (hidden-state indices its steps store, their width,
        the head's KV bytes per token, which the runner budgets with its own blocks)."""
        from jaxserve.spec_decode.eagle_loader import read_spec

        spec = read_spec(config.model, config.method, target_text_config)
        c = spec.config
        return spec.aux_layers, spec.aux_width, 2 * c.num_key_value_heads * c.head_dim * itemsize

    @classmethod
    def build(cls, config, args, target_runner, target_text_config, progress: bool) -> "EagleProposer":
        from jaxserve import sharding
        from jaxserve.kv_cache import allocate_kv_caches
        from jaxserve.pallas_kernels import kv_layout
        from jaxserve.pallas_kernels.attention import GATHER_BACKENDS, get_attention_fn
        from jaxserve.pallas_kernels.fp8 import storage_dtype
        from jaxserve.spec_decode.eagle_loader import load_head, read_spec

        r = target_runner
        rc = r.runner_config
        spec = read_spec(config.model, config.method, target_text_config)
        c = spec.config
        tp = r.mesh.shape["model"]
        attention_fn = get_attention_fn(rc.attention_backend, rc.platform, tp)
        if tp > 1:  # the head is sharded as the target is (EaglePrograms): whole heads per device
            try:
                sharding.check_tensor_parallel(c, tp)
            except ValueError as e:
                raise ValueError(f"speculative_config model={config.model!r} (the EAGLE head): {e}") from None
            if rc.attention_backend not in GATHER_BACKENDS:
                attention_fn = sharding.shard_attention(attention_fn, r.mesh)
        head, d2t = load_head(
            spec, config.model, dtype=r.dtype, attention_fn=attention_fn, seed=args.seed,
            dummy=args.load_format == "dummy", fp32_matmul_precision=r.model_config.fp32_matmul_precision,
            shardings_fn=sharding.shardings_fn(r.mesh),
        )  # fmt: skip
        kv_shape = (r.num_blocks, r.block_size, c.num_key_value_heads, c.head_dim)
        kv_dtype = storage_dtype(r.dtype, rc.platform, rc.attention_backend in GATHER_BACKENDS)  # bf16 bits on CPU
        heads_major = r.kv_heads_major  # the head's layer reads its cache with the target's attention backend
        pages = kv_layout.pages_shape(*kv_shape, heads_major)
        kv = allocate_kv_caches(1, *kv_shape, kv_dtype, heads_major=heads_major,
                                sharding=sharding.logical_sharding(r.mesh, sharding.kv_cache_axes(heads_major), pages))
        programs = EaglePrograms(r, head, d2t, kv, config.num_speculative_tokens)
        sc = r.scheduler_config
        proposer = cls(programs, sc.max_num_batched_tokens, sc.max_num_seqs)
        seconds = programs.warmup() + proposer.fed.warmup()
        logger.info("EAGLE-%d head %s (reads target hidden states %s): %d proposal programs ready in %.1fs "
                    "(%d loaded from the executable store)", spec.version, config.model, list(spec.aux_layers),
                    len(programs.shapes()) + len(proposer.fed.shapes()), seconds,
                    programs.num_loaded_programs + proposer.fed.num_loaded_programs)
        return proposer

    def _steady(self, seq, r: Request) -> bool:
        """The head's cache holds this request's pairs up to the verify step's first position, as the last
        round left it."""
        st = self._states.get(r.request_id)
        return st is not None and st.num_preemptions == r.num_preemptions and st.valid == seq.start_pos

    def _num_fed(self, r: Request) -> int:
        return 0  # the pairs the round fed hold guesses: never kept

    def _record_fed(self, r: Request, blocks: list[int], kv) -> bool:
        self._record(r, [])  # the scheduler allocates the proposals' slots; the head's state has no proposals
        return True

    def _fill_fed(self, r: Request, proposals: list[int]) -> None:
        pass

    def _fed_extra(self, handle) -> tuple:
        return (handle.states,)  # the target's hidden states of the verify step's tokens [S, K+1, W]

    def _record(self, r: Request, proposals: list[int]) -> None:
        self._states[r.request_id] = _HeadState(r.num_preemptions, r.num_tokens - 1)

    def propose(self, requests: list[Request], k: int, kv, live: list[Request] | None = None) -> None:
        """Set ``spec_token_ids`` (k greedy head tokens) on each request that has room for them. ``live``: the
        requests whose state to keep (default: ``requests``; more when a fed round served the others)."""
        if k != self.programs.k:
            raise ValueError(f"the EAGLE programs were built for k={self.programs.k}, not k={k}")
        live = {r.request_id for r in (requests if live is None else live)}
        self._states = {rid: s for rid, s in self._states.items() if rid in live}
        rn = self.programs.runner
        last_position = rn.max_blocks_per_seq * rn.block_size - 1
        todo = []
        for r in requests:
            # The round writes positions up to N + k - 3; the verify step needs slots up to N + k - 2 anyway.
            if r.num_tokens < 2 or r.num_tokens + k - 2 > last_position or not kv.allocate_slots(r, k):
                continue
            todo.append((r, self._valid(r), kv.get_block_ids(r)))
        if not todo:
            return
        cursor = [valid for _, valid, _ in todo]
        # A long catch-up (a prompt) runs in rounds within the token budget first; their proposals are dropped
        # and their decode steps' guesses are overwritten by the next chunk.
        while sum(r.num_tokens - 1 - c for (r, _, _), c in zip(todo, cursor)) > self.budget:
            chunk, budget = [], self.budget
            for i, (r, _, _) in enumerate(todo):
                take = min(r.num_tokens - 2 - cursor[i], budget)
                if take > 0:
                    chunk.append((i, take))
                    budget -= take
            self._round(todo, cursor, dict(chunk), k)
            for i, take in chunk:
                cursor[i] += take
        proposals = self._round(todo, cursor, None, k)
        for (r, _, _), row in zip(todo, proposals.tolist()):
            r.spec_token_ids = row
            self._record(r, row)

    def _round(self, todo, cursor: list[int], take: dict | None, k: int) -> np.ndarray:
        """One program over the pairs from each cursor (``take``: that many, for the listed requests only;
        None: all up to N - 2). -> proposals [n, k]."""
        rows = [i for i in range(len(todo)) if take is None or i in take]
        seqs, ends, blocks = [], [], []
        for i in rows:
            r, _, b = todo[i]
            end = r.num_tokens - 1 if take is None else cursor[i] + take[i]  # pairs at positions [cursor, end)
            seqs.append(_seq(r, r.all_token_ids[cursor[i] + 1 : end + 1], cursor[i], b))
            ends.append(end + k - 1)
            blocks.append(b)
        x = round_inputs(seqs, ends, blocks, self.programs.runner, self.max_seqs)
        return np.asarray(jax.device_get(self.programs(x)))[: len(rows)]

    def _valid(self, r: Request) -> int:
        s = self._states.get(r.request_id)
        if s is None or s.num_preemptions != r.num_preemptions:
            return 0
        return min(s.valid, r.num_tokens - 2)

"""Draft-model proposals: a smaller model with the target's tokenizer guesses k tokens greedily.

The draft has its own ModelRunner (its own weights, KV cache and bucketed, jitted steps) with as many KV
blocks as the target, and it writes its KV through the *target's* block tables: the target's block manager
decides where every position lives, and no second allocator has to agree with it.

What the draft's cache holds is tracked per request (``_DraftState``): positions below ``valid`` hold the
draft's KV of the request's real tokens. Each round first catches up (runs the tokens from ``valid`` to the
last known one; the sample at the last one is proposal 0), then feeds proposal j at position N + j to get
proposal j + 1. Both happen in one jitted program (``draft_program``): the host builds one batch and reads back
one [S, k] array per round; only a catch-up longer than the token budget (a prompt) first runs its leading
chunks as plain steps of the draft's runner. Positions N.. then hold proposals; after verification only
those equal to the tokens the target accepted stay valid (the prefix of proposals matching the sequence), so
the draft's cache is consistent after any rejection. A rejected proposal's slot may be handed to another
request, but positions counted valid are never among them (they lie before the target's computed length).
A request the prefix cache served, or one that was preempted, starts from 0: the draft recomputes its prompt.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import ScheduledSeq, SchedulerOutput
from jaxserve.spec_decode.draft_program import DraftPrograms, round_inputs
from jaxserve.spec_decode.fed_rounds import FedPrograms, FedRoundsMixin

logger = logging.getLogger("jaxserve")

_GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class _DraftState:
    num_preemptions: int  # the request's count when this was recorded: a preemption frees the blocks
    valid: int  # positions [0, valid) of the draft cache hold the draft KV of the request's tokens
    proposal_start: int = 0  # position of the first proposal made last round
    fed: list = dataclasses.field(default_factory=list)  # proposals whose KV the draft wrote (all but the last)
    # A fed round's proposals not read yet (FedRoundsMixin.claim_fed): whether their KV is kept, until _fill_fed.
    pending_keep: bool | None = None


class DraftProposer(FedRoundsMixin):
    def __init__(self, runner, max_num_batched_tokens: int, max_num_seqs: int, k: int) -> None:
        self.runner = runner  # the draft's ModelRunner
        self.programs = DraftPrograms(runner, k)  # the fused proposal programs (catch-up + k - 1 decodes)
        self.fed = FedPrograms(self.programs, k)  # rounds fed by the verify step on the device (fed_rounds)
        self.budget = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self._states: dict[str, _DraftState] = {}

    @classmethod
    def build(cls, config, args, target_runner, target_text_config, mesh, progress: bool) -> "DraftProposer":
        """Load the draft checkpoint beside the target (same dtype, mesh and KV block layout)."""
        import jax.numpy as jnp

        from jaxserve import sharding
        from jaxserve.model_loader import load_model, resolve_model_path
        from jaxserve.model_runner import ModelRunner
        from jaxserve.pallas_kernels.attention import GATHER_BACKENDS, get_attention_fn

        rc = target_runner.runner_config
        if rc.platform != "cpu" and args.num_gpu_blocks_override is None:
            raise ValueError(
                "speculative_config method='draft_model' on an accelerator needs --num-gpu-blocks-override: the "
                "target's KV cache is sized first and would leave no memory for the draft's (it has as many blocks); "
                "e.g. --num-gpu-blocks-override 4096 (65k tokens of 16)"
            )
        attention_fn = get_attention_fn(rc.attention_backend, rc.platform, mesh.shape["model"])
        if mesh.shape["model"] > 1 and rc.attention_backend not in GATHER_BACKENDS:
            attention_fn = sharding.shard_attention(attention_fn, mesh)
        # A dummy-weight target (benchmarks) gets a dummy-weight draft of the shape config.model's config.json gives.
        path, fmt = resolve_model_path(config.model, "dummy" if args.load_format == "dummy" else "auto")
        mc = target_runner.model_config
        model, text_config = load_model(
            path, fmt, dtype=jnp.dtype(mc.dtype), attention_fn=attention_fn, seed=args.seed,
            shardings_fn=sharding.shardings_fn(mesh), fp32_matmul_precision=mc.fp32_matmul_precision, progress=progress,
            quantization=config.quantization, num_devices=mesh.shape["model"],
        )
        if text_config.vocab_size != target_text_config.vocab_size:
            raise ValueError(
                f"speculative_config model={config.model!r} has vocab_size={text_config.vocab_size}, but the target "
                f"has vocab_size={target_text_config.vocab_size}: a draft model must share the target's tokenizer "
                "(e.g. a smaller model of the same family)"
            )
        if text_config.max_position_embeddings < mc.max_model_len:
            raise ValueError(
                f"speculative_config model={config.model!r} has max_position_embeddings="
                f"{text_config.max_position_embeddings} < max_model_len={mc.max_model_len}: lower --max-model-len"
            )
        cache = dataclasses.replace(target_runner.cache_config, num_gpu_blocks_override=target_runner.num_blocks)
        draft_mc = dataclasses.replace(
            mc, model=path, model_format=fmt, served_model_name=f"{mc.served_model_name}-draft"
        )
        sc = target_runner.scheduler_config
        runner = ModelRunner(model, text_config, draft_mc, cache, sc, rc, mesh=mesh)
        runner.warmup(progress=progress)  # its plain steps: the chunks of a long catch-up (a prompt)
        proposer = cls(runner, sc.max_num_batched_tokens, sc.max_num_seqs, config.num_speculative_tokens)
        seconds = proposer.programs.warmup() + proposer.fed.warmup()
        logger.info("draft model %s: %d KV blocks (the target's layout), %d proposal programs ready in %.1fs "
                    "(%d loaded from the executable store)", path, runner.num_blocks,
                    len(proposer.programs.shapes()) + len(proposer.fed.shapes()), seconds,
                    proposer.programs.num_loaded_programs + proposer.fed.num_loaded_programs)
        return proposer

    def _steady(self, seq: ScheduledSeq, r: Request) -> bool:
        """The draft cache is as the last round left it, for exactly these proposals: real tokens below N, then
        the proposals it fed, which the verified ones start with."""
        st = self._states.get(r.request_id)
        if st is None or st.pending_keep is not None:
            return False
        n = seq.start_pos + 1
        verified = seq.token_ids[1:]
        m = min(len(verified), len(st.fed))
        return st.num_preemptions == r.num_preemptions and st.valid == st.proposal_start == n and verified[:m] == st.fed[:m]

    def _num_fed(self, r: Request) -> int:
        return len(self._states[r.request_id].fed)

    def _record_fed(self, r: Request, blocks: list[int], kv) -> bool:
        """As an ordinary round would: slots up to N + k - 2. The proposals it fed keep their KV only if the
        request holds the blocks the round wrote them through (free_tail may have handed them on); their values
        come with ``_fill_fed``."""
        k = self.programs.k
        if not kv.allocate_slots(r, k):
            return False
        n = -(-(r.num_tokens + k - 1) // self.runner.block_size)
        kept = list(kv.get_block_ids(r)[:n]) == blocks[:n]
        self._states[r.request_id] = _DraftState(r.num_preemptions, r.num_tokens, r.num_tokens, [], kept)
        return True

    def _fill_fed(self, r: Request, proposals: list[int]) -> None:
        st = self._states.get(r.request_id)
        if st is not None and st.pending_keep is not None:
            st.fed, st.pending_keep = (proposals[:-1] if st.pending_keep else []), None

    def _record(self, r: Request, proposals: list[int]) -> None:
        self._states[r.request_id] = _DraftState(r.num_preemptions, r.num_tokens, r.num_tokens, proposals[:-1])

    def propose(self, requests: list[Request], k: int, kv, live: list[Request] | None = None) -> None:
        """Set ``spec_token_ids`` (k greedy draft tokens) on each request that has room for them."""
        if k != self.programs.k:
            raise ValueError(f"the draft's programs were built for k={self.programs.k}, not k={k}")
        live = {r.request_id for r in (requests if live is None else live)}
        self._states = {rid: s for rid, s in self._states.items() if rid in live}
        todo = []
        last_position = self.runner.max_blocks_per_seq * self.runner.block_size - 1
        for r in requests:
            # Slots up to position N + k - 2 (proposal j is fed at N + j, j < k - 1); the target's verify step
            # needs the same ones, so this only moves its allocation earlier. Near max_model_len: no proposals.
            if r.num_tokens + k - 2 > last_position or not kv.allocate_slots(r, k):
                continue
            todo.append((r, self._valid(r), kv.get_block_ids(r)))
        if not todo:
            return
        cursor = self._prefill_until_fits(todo)
        # One program: every request's remaining catch-up, then k - 1 decode steps on the device; one read-back.
        seqs = [_seq(r, r.all_token_ids[cursor[i]:], cursor[i], blocks) for i, (r, _, blocks) in enumerate(todo)]
        ends = [r.num_tokens + k - 1 for r, _, _ in todo]  # positions the round writes, per request
        x = round_inputs(seqs, ends, [blocks for _, _, blocks in todo], self.runner, self.max_seqs)
        proposals = np.asarray(jax.device_get(self.programs(x)))[: len(todo)]  # [n, k]
        for (r, _, _), row in zip(todo, proposals.tolist()):
            r.spec_token_ids = row
            self._record(r, row)

    def _prefill_until_fits(self, todo) -> list[int]:
        """Run long catch-ups (prompts) in plain chunked steps through the runner until every request's rest fits
        one batch of the draft's token budget; each keeps at least its last token for the fused program.
        Returns each request's catch-up start. The steps are only dispatched: the cache orders them."""
        cursor = [valid for _, valid, _ in todo]
        while sum(r.num_tokens - c for (r, _, _), c in zip(todo, cursor)) > self.budget:
            seqs, budget = [], self.budget
            for i, (r, _, blocks) in enumerate(todo):
                take = min(r.num_tokens - 1 - cursor[i], budget)
                if take <= 0 or len(seqs) == self.max_seqs:
                    continue
                seqs.append(_seq(r, r.all_token_ids[cursor[i] : cursor[i] + take], cursor[i], blocks, sample=False))
                cursor[i] += take
                budget -= take
            self._dispatch(seqs)
        return cursor

    def _valid(self, r: Request) -> int:
        """How many leading positions of the draft cache hold this request's real tokens now."""
        s = self._states.get(r.request_id)
        if s is None or s.num_preemptions != r.num_preemptions:
            return 0
        real = r.all_token_ids[s.proposal_start : s.proposal_start + len(s.fed)]
        matched = 0
        while matched < len(real) and real[matched] == s.fed[matched]:
            matched += 1
        return min(s.valid + matched, r.num_tokens - 1)

    def _dispatch(self, seqs: list[ScheduledSeq]):
        return self.runner.dispatch(SchedulerOutput(seqs=seqs, num_batched_tokens=sum(len(s.token_ids) for s in seqs)))


def _seq(r: Request, token_ids: list[int], start: int, blocks: list[int], sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(
        req_id=r.request_id, token_ids=list(token_ids), start_pos=start, block_ids=blocks, sample=sample,
        sampling_params=_GREEDY, seed=0, num_output_tokens=0, history=[], num_prompt_tokens=r.num_prompt_tokens,
    )

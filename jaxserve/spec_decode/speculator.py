"""Speculator: what the engine holds when speculative decoding is on (proposer + verify step + statistics).

The loop with speculation runs one step at a time (schedule, verify, read back, propose): the next step's
proposals depend on which tokens this step accepted, so it cannot be dispatched before this one is read. A
draft model's or EAGLE head's next round, though, is dispatched right behind the verify step in the steady
state, fed by its tokens on the device (``fed_rounds``), so the host's work on the step's tokens overlaps it;
and its proposals are not read before the next verify step is launched: that step reads them on the device,
so the host schedules and dispatches it while the round still runs. Without ``speculative_config`` the
asynchronous loop is unchanged.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxserve.request import Request, RequestStatus
from jaxserve.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.spec_decode.stats import SpecDecodeStats
from jaxserve.spec_decode.verify import VerifyRunner


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner, draft: Optional[object] = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.verifier = VerifyRunner(runner, self.k, config.forced_acceptance_length)
        self.ngram = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft = draft  # a DraftProposer ("draft_model") or an EagleProposer ("eagle", "eagle3")
        self.stats = SpecDecodeStats(self.k)
        self._fed = None  # (FedRound, emitted per row): a proposal round dispatched behind the verify step
        self._claimed = None  # a FedRound whose proposals requests hold as placeholders (claim_fed), not read yet
        self.num_fed_rounds = 0
        self.num_device_fed_steps = 0  # verify steps that read some proposals on the device
        # Fed rounds (fed_rounds.py) by default on accelerators only: on CPU the host's work cannot overlap the
        # device's (the same cores), and a fed catch-up takes the verify step's token bucket (16 for k = 4), not
        # its own (4 for 1-2 tokens), which costs CPU matmuls real time. JAXSERVE_SPEC_FED=1 / 0 forces them.
        forced = os.environ.get("JAXSERVE_SPEC_FED")
        self.fed_rounds = runner.runner_config.platform != "cpu" if forced is None else forced != "0"

    def dispatch(self, sched: SchedulerOutput, kv=None):
        """The verify step; with a draft model or an EAGLE head and ``kv`` (the block manager), in the steady state
        also the next proposal round, fed on the device by the verify step's tokens (spec_decode.fed_rounds)."""
        claimed, self._claimed = self._claimed, None
        seqs, fed_rows = {}, {}
        if claimed is not None:
            for i, seq in enumerate(sched.seqs):
                seqs[seq.req_id] = seq
                if seq.num_spec_tokens and seq.req_id in claimed.claimed:
                    fed_rows[i] = claimed.claimed[seq.req_id][0]
        if fed_rows:
            handle = self.verifier.dispatch(sched, claimed.proposals, fed_rows)
            self.num_device_fed_steps += 1
        else:
            handle = self.verifier.dispatch(sched)
        if claimed is not None:  # the values, for the host's records (the round ran before this step)
            self.draft.resolve_fed(claimed, seqs)
        self._fed = None
        if kv is not None and self.fed_rounds and hasattr(self.draft, "dispatch_fed"):
            fed = self.draft.dispatch_fed(sched, handle, kv)
            self._fed = None if fed is None else (fed, None)
            self.num_fed_rounds += fed is not None
        return handle

    def fetch(self, sched: SchedulerOutput, handle) -> ModelRunnerOutput:
        out = self.verifier.fetch(handle)
        if self._fed is not None:
            self._fed = (self._fed[0], [len(e) for e in out.emitted_token_ids])
        for row, seq in enumerate(sched.seqs):
            if seq.num_spec_tokens and not sched.requests[row].is_finished:
                self.stats.record(seq.num_spec_tokens, len(out.emitted_token_ids[row]) - 1)
        return out

    def propose(self, running: list[Request], kv) -> None:
        """Set ``spec_token_ids`` of every running request that decodes next step and may speculate."""
        eligible = [r for r in running if r.status == RequestStatus.RUNNING and _may_speculate(r)]
        if self.ngram is not None:
            pad = self.config.forced_acceptance_length is not None  # benchmarks: always verify k proposals
            for r in eligible:
                proposal = self.ngram.propose(r.all_token_ids, self.k, key=r)
                r.spec_token_ids = (proposal + [r.all_token_ids[-1]] * self.k)[: self.k] if pad else proposal
            self.ngram.retain(running)  # the token buffers of requests still running (finished ones' go)
        elif self.draft is not None:
            if self._fed is not None:
                fed, emitted = self._fed
                self._fed = None
                rest = self.draft.claim_fed(fed, eligible, emitted, kv)
                self._claimed = fed if fed.claimed else None
                if not self.draft.device_fed_verify:
                    self.materialize()  # read now: the next verify step is launched once the round is done
                self.draft.propose(rest, self.k, kv, live=eligible)
            else:
                self.draft.propose(eligible, self.k, kv)

    def materialize(self) -> None:
        """Read proposals still held on the device as placeholders (the next verify step was to read them there)
        into the requests' ``spec_token_ids``: for a step that verifies none, and for tests that look at them."""
        claimed, self._claimed = self._claimed, None
        if claimed is not None:
            self.draft.resolve_fed(claimed, {})


def _may_speculate(r: Request) -> bool:
    """Decoding next (prompt done, nothing in flight), and no setting that reads the tokens mid-step: penalties or
    a grammar (SamplingParams.needs_host_tokens; a grammar's mask at each position would follow the proposals
    before it), or min_tokens' bans on stop tokens. Such a request decodes one token per verify step, beside the
    others."""
    sp = r.sampling_params
    return (
        r.num_computed_tokens == r.num_tokens - 1
        and not r.num_pending_tokens
        and not sp.needs_host_tokens
        and r.num_output_tokens >= sp.min_tokens
    )

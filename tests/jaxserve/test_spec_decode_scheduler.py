"""Scheduler and block manager under speculative decoding, device-free.

A fake runner (test_scheduler's paged fake KV: each slot holds (position, token), and every context is read
back out of the slots) verifies proposals as a model would: proposal j is accepted while it equals the fake
model's next token for the context read back, then one more token is emitted. Proposals are the true
continuation with random corruption and random lengths, so every acceptance length, rejection rollback,
stop token inside a step, max_tokens cut, preemption and prefix hit occurs. A rejected proposal's KV that
survived in a block another request later shares would show up as a wrong context read back.
"""

import random

import pytest
from test_scheduler import (
    VOCAB,
    FakeRunner,
    assert_all_freed,
    drive_with_arrivals,
    make_req,
    make_sched,
    next_token,
    stress_sched,
)

from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler_output import ModelRunnerOutput

K = 4


class SpecFakeRunner(FakeRunner):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.accepted = [0] * (K + 1)

    def read(self, seq, end):
        return [self.slots[seq.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(end)]

    def execute(self, out):
        emitted = []
        for seq in out.seqs:
            end = seq.start_pos + len(seq.token_ids)
            assert len(seq.block_ids) * self.bs >= end and 0 not in seq.block_ids
            for pos, tok in enumerate(seq.token_ids, seq.start_pos):
                self.slots[seq.block_ids[pos // self.bs] * self.bs + pos % self.bs] = (pos, tok)
            if not seq.sample:
                emitted.append([-1])
                continue
            n = seq.num_spec_tokens
            known = end - n
            assert known == len(seq.history) and seq.token_ids[: len(seq.token_ids) - n] == seq.history[seq.start_pos :]
            context = self.read(seq, end)
            assert context[:known] == list(enumerate(seq.history)), f"KV of {seq.req_id} corrupted"
            tokens = [t for _, t in context]
            new = []
            for j in range(n + 1):
                t = next_token(tokens[: known + j])
                new.append(t)
                if j == n or t != tokens[known + j]:
                    break
            self.accepted[len(new) - 1] += n > 0
            emitted.append(new)
        return ModelRunnerOutput(sampled_token_ids=[e[0] for e in emitted], emitted_token_ids=emitted)


def propose(sched, rng):
    for r in sched.running:
        if r.num_computed_tokens != r.num_tokens - 1 or rng.random() < 0.2:
            continue
        ctx = list(r.all_token_ids)
        proposal = []
        for _ in range(rng.randint(1, K)):
            proposal.append(next_token(ctx))
            ctx.append(proposal[-1])
        if rng.random() < 0.6:
            proposal[rng.randrange(len(proposal))] = rng.randrange(VOCAB)
        r.spec_token_ids = proposal


def expected(prompt, max_tokens, eos, max_len):
    history, out = list(prompt), []
    while len(out) < max_tokens and len(history) < max_len:
        out.append(next_token(history))
        history.append(out[-1])
        if out[-1] in eos:
            break
    return out


@pytest.mark.parametrize("seed", range(8))
def test_stress_with_proposals(seed):
    rng = random.Random(seed)
    max_model_len = 96
    sched = stress_sched(seed, rng, max_model_len)
    runner = SpecFakeRunner(sched.kv.num_blocks, 4)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    wanted, pending = {}, []
    for i in range(50):
        prompt = (shared[: rng.randint(0, 24)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 50))])[:80]
        max_tokens = rng.randint(1, 30)
        eos = (rng.randrange(VOCAB),) if i % 3 == 0 else ()
        pending.append(make_req(f"r{i}", prompt, eos=eos, max_tokens=max_tokens, ignore_eos=not eos))
        wanted[f"r{i}"] = expected(prompt, max_tokens, eos, min(max_model_len, sched.max_len))

    def run(on_step):
        finished = {}
        for n in range(10_000):
            if not sched.has_unfinished_requests():
                return finished
            out = sched.schedule()
            assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.seqs) <= sched.max_num_batched_tokens
            for r in sched.update_from_output(out, runner.execute(out)):
                if r.is_finished:
                    finished[r.request_id] = r
            propose(sched, rng)
            on_step(n, out)
        raise AssertionError("did not finish")

    finished = drive_with_arrivals(sched, pending, wanted, rng, run)
    assert set(finished) == set(wanted)
    for rid, req in finished.items():
        assert req.output_token_ids == wanted[rid], rid
    assert_all_freed(sched)
    assert all(runner.accepted), runner.accepted  # every acceptance length 0..K happened


def test_rejected_slots_are_freed_and_computed_rolls_back():
    sched = make_sched(block_size=4)
    runner = SpecFakeRunner(200, 4)
    req = make_req("a", range(1, 8), max_tokens=20, ignore_eos=True)  # 7 prompt tokens
    sched.add_request(req)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))  # prefill + first token: 8 tokens
    assert req.num_computed_tokens == 7 and sched.kv.num_held_blocks(req) == 2
    req.spec_token_ids = [90, 91, 92, 93, 94, 95]
    out = sched.schedule()
    (seq,) = out.seqs
    assert seq.num_spec_tokens == 6 and len(seq.token_ids) == 7 and sched.kv.num_held_blocks(req) == 4  # 14 slots
    sched.update_from_output(out, runner.execute(out))
    accepted = req.num_output_tokens - 2
    assert req.num_computed_tokens == 8 + accepted
    assert sched.kv.num_held_blocks(req) == -(-(req.num_computed_tokens + 1) // 4)
    assert req.spec_token_ids == []


def test_proposals_are_cut_by_max_tokens_and_budget():
    sched = make_sched(block_size=4, max_num_batched_tokens=4)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(req)
    runner = SpecFakeRunner(200, 4)
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    req.spec_token_ids = [7, 7, 7, 7, 7]
    (seq,) = sched.schedule().seqs
    assert seq.num_spec_tokens == 1  # max_tokens=3 with one emitted: at most 2 more tokens, so 1 proposal
    assert RequestStatus.RUNNING == req.status

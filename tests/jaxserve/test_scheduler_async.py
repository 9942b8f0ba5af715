"""Asynchronous scheduling at the scheduler level: step N+1 is scheduled before step N's tokens are read.

The fake runner plays the device: it runs a step when it is dispatched, taking each placeholder input
token from the samples of the step dispatched just before (as the jitted step does), writing every
token's KV into the slot its block table names and checking the context it reads back. The host side
reads results one step late, as LLMEngine does. Outputs must equal a one-step-at-a-time run exactly:
a token computed past a stop (EOS, abort, max_tokens) is never emitted, and nothing accepted is lost.
"""

import random

import pytest
from test_scheduler import (
    VOCAB, assert_all_freed, drive_with_arrivals, make_req, make_sched, next_token, stress_sched,
)

from jaxserve.request import RequestStatus
from jaxserve.scheduler_output import ModelRunnerOutput


class DeviceFake:
    """Runs steps in dispatch order; placeholders come from the previous dispatch's samples."""

    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.slots = [None] * (num_blocks * block_size)
        self.last_sampled: list[int] = []
        self.num_dispatched_samples = 0

    def dispatch(self, out):
        sampled = []
        for seq in out.seqs:
            tokens = list(seq.token_ids)
            if seq.num_placeholders:
                assert tokens[-1] == -1 and seq.prev_row >= 0
                tokens[-1] = self.last_sampled[seq.prev_row]
            assert -1 not in tokens
            end = seq.start_pos + len(tokens)
            for pos, tok in enumerate(tokens, seq.start_pos):
                self.slots[seq.block_ids[pos // self.bs] * self.bs + pos % self.bs] = (pos, tok)
            if not seq.sample:
                sampled.append(-1)
                continue
            context = [self.slots[seq.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(end)]
            assert [pos for pos, _ in context] == list(range(end)), f"KV of {seq.req_id} corrupted"
            known = seq.history[: min(end, len(seq.history))]
            assert [tok for _, tok in context][: len(known)] == known, f"KV of {seq.req_id} corrupted"
            sampled.append(next_token([tok for _, tok in context]))
            self.num_dispatched_samples += 1
        self.last_sampled = sampled
        return ModelRunnerOutput(sampled_token_ids=sampled)


def expected(prompt, max_tokens, eos=(), max_len=10**9):
    history = list(prompt)
    while len(history) - len(prompt) < max_tokens and len(history) < max_len:
        history.append(next_token(history))
        if history[-1] in eos:
            break
    return history[len(prompt) :]


def run_async(sched, device, on_step=None, max_steps=10_000):
    """The engine's loop: schedule and dispatch N+1, then apply N. Returns finished requests."""
    finished = {}
    in_flight = None
    for n in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return finished
        out = sched.schedule()
        previous, in_flight = in_flight, None
        if out.seqs:
            in_flight = (out, device.dispatch(out))
        if previous is not None:
            for r in sched.update_from_output(*previous):
                if r.is_finished:
                    finished[r.request_id] = r
        if on_step:
            on_step(n, out)
    raise AssertionError("did not finish")


def test_eos_in_step_n_drops_the_token_computed_in_step_n_plus_1():
    prompt = [5, 9, 14, 3]
    want = expected(prompt, 20)
    eos = want[3]  # the 4th generated token is the stop
    sched = make_sched()
    device = DeviceFake(200, 4)
    req = make_req("a", prompt, eos=(eos,), max_tokens=20)
    sched.add_request(req)
    finished = run_async(sched, device)
    assert finished["a"].output_token_ids == want[: want.index(eos) + 1]
    assert finished["a"].status == RequestStatus.FINISHED_STOPPED
    # The step after the EOS step was already dispatched: it sampled one token nobody sees.
    assert device.num_dispatched_samples == len(req.output_token_ids) + 1
    assert_all_freed(sched)


def test_max_tokens_is_known_ahead_and_wastes_no_step():
    sched = make_sched()
    device = DeviceFake(200, 4)
    req = make_req("a", [1, 2, 3], max_tokens=6, ignore_eos=True)
    sched.add_request(req)
    finished = run_async(sched, device)
    assert finished["a"].output_token_ids == expected([1, 2, 3], 6)
    assert device.num_dispatched_samples == 6
    assert_all_freed(sched)


def test_placeholder_feeds_the_next_step_and_counts_as_generated():
    sched = make_sched()
    device = DeviceFake(200, 4)
    req = make_req("a", [7, 8, 9], max_tokens=4, ignore_eos=True)
    sched.add_request(req)
    first = sched.schedule()
    out1 = device.dispatch(first)
    assert req.num_pending_tokens == 1 and req.num_computed_tokens == 3 and req.output_token_ids == []
    second = sched.schedule()  # before the first step's token is known
    (seq,) = second.seqs
    assert (seq.start_pos, seq.token_ids, seq.num_placeholders, seq.prev_row) == (3, [-1], 1, 0)
    assert seq.num_output_tokens == 1  # the sampler's step counter includes the pending token
    out2 = device.dispatch(second)
    assert req.num_pending_tokens == 2
    sched.update_from_output(first, out1)
    assert req.num_pending_tokens == 1 and len(req.output_token_ids) == 1
    sched.update_from_output(second, out2)
    assert req.output_token_ids == expected([7, 8, 9], 2)


def test_abort_in_flight_ignores_the_row_and_frees_blocks():
    sched = make_sched()
    device = DeviceFake(200, 4)
    a = make_req("a", [1, 2, 3, 4, 5], max_tokens=10, ignore_eos=True)
    b = make_req("b", [6, 7, 8], max_tokens=10, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    r1 = device.dispatch(first)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # while step 1 is in flight
    second = sched.schedule()
    assert [s.req_id for s in second.seqs] == ["b"]
    r2 = device.dispatch(second)
    updated = sched.update_from_output(first, r1)
    assert updated == [b] and a.output_token_ids == []
    sched.update_from_output(second, r2)
    finished = run_async(sched, device)
    assert finished["b"].output_token_ids == expected([6, 7, 8], 10)
    assert_all_freed(sched)


def test_preempted_with_a_token_in_flight_keeps_it_and_resumes():
    # 6 usable blocks of 4: two requests of 8 + growing outputs cannot both stay.
    sched = make_sched(num_blocks=7, max_num_batched_tokens=32)
    device = DeviceFake(7, 4)
    reqs = [make_req(f"r{i}", [i + 1] * 8, max_tokens=12, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    finished = run_async(sched, device)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert finished[r.request_id].output_token_ids == expected(r.prompt_token_ids, 12)
    assert_all_freed(sched)


@pytest.mark.parametrize("seed", range(12))
def test_stress_async_equals_sync(seed):
    rng = random.Random(seed)
    max_model_len = 96
    sched = stress_sched(seed, rng, max_model_len)
    device = DeviceFake(sched.kv.num_blocks, 4)
    eos = (rng.randrange(VOCAB), rng.randrange(VOCAB))
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    wanted, pending = {}, []
    for i in range(50):
        prompt = (shared[: rng.randint(0, 24)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))])[:80]
        max_tokens = rng.randint(1, 30)
        ignore_eos = rng.random() < 0.3
        pending.append(make_req(f"r{i}", prompt, eos=eos, max_tokens=max_tokens, ignore_eos=ignore_eos))
        wanted[f"r{i}"] = expected(prompt, max_tokens, () if ignore_eos else eos, max_model_len)

    # Aborts land between a schedule and the read-back of the step before: often with a step in flight.
    finished = drive_with_arrivals(
        sched, pending, wanted, rng, lambda on_step: run_async(sched, device, on_step=on_step), abort_phase=(5, 2)
    )
    assert set(finished) == set(wanted)
    for rid, req in finished.items():
        assert req.output_token_ids == wanted[rid], rid
        assert req.num_pending_tokens == 0
    assert_all_freed(sched)

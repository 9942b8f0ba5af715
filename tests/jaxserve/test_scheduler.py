"""Scheduler: token budget, chunked prefill, prefix hits, preemption, stop checks, and a stress test.

The fake runner keeps a real paged "KV cache" of (position, token) per slot, writes each scheduled token
into the slot its block table names, and reads the whole context back out of those slots before
"sampling". So any block-manager bug (a block shared or reused while live, a wrong prefix hit) shows up
as a wrong context, and the next token is a deterministic function of the context read back.
"""

import random

import pytest

from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.scheduler_output import ModelRunnerOutput

VOCAB = 97


def next_token(context):
    """The fake model: a deterministic function of the whole context (its length and last tokens)."""
    return (len(context) * 31 + sum(context[-3:]) * 7 + context[0]) % VOCAB


class FakeRunner:
    def __init__(self, num_blocks, block_size):
        self.bs = block_size
        self.slots = [None] * (num_blocks * block_size)

    def execute(self, out):
        sampled = []
        for seq in out.seqs:
            end = seq.start_pos + len(seq.token_ids)
            assert seq.token_ids == seq.history[seq.start_pos : end]
            assert len(seq.block_ids) * self.bs >= end and 0 not in seq.block_ids
            for pos, tok in enumerate(seq.token_ids, seq.start_pos):
                self.slots[seq.block_ids[pos // self.bs] * self.bs + pos % self.bs] = (pos, tok)
            if not seq.sample:
                sampled.append(-1)
                continue
            assert end == len(seq.history)
            context = [self.slots[seq.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(end)]
            assert context == list(enumerate(seq.history)), f"KV of {seq.req_id} corrupted"
            sampled.append(next_token(seq.history))
        return ModelRunnerOutput(sampled_token_ids=sampled)


def expected_output(prompt, n):
    history = list(prompt)
    for _ in range(n):
        history.append(next_token(history))
    return history[len(prompt) :]


def make_sched(**kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4, num_blocks=200)
    args.update(kw)
    return Scheduler(**args)


def make_req(req_id, prompt, eos=(), **params):
    params.setdefault("max_tokens", 8)
    return Request(req_id, list(prompt), SamplingParams(**params), eos_token_ids=eos)


def step(sched, runner):
    out = sched.schedule()
    assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.seqs) <= sched.max_num_batched_tokens
    assert len(out.seqs) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    assert len({s.req_id for s in out.seqs}) == len(out.seqs)
    return out, sched.update_from_output(out, runner.execute(out))


def run_all(sched, runner, max_steps=10_000, on_step=None):
    finished = {}
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished, n
        out, updated = step(sched, runner)
        for r in updated:
            if r.is_finished:
                finished[r.request_id] = r
        if on_step:
            on_step(n, out)
    raise AssertionError("did not finish")


def assert_all_freed(sched):
    assert sched.kv_cache_usage == 0.0
    assert all(b.ref_cnt == 0 for b in sched.kv.blocks)
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks


def test_single_request_prefill_then_decode():
    sched = make_sched()
    runner = FakeRunner(200, 4)
    req = make_req("a", range(1, 11), max_tokens=5)
    sched.add_request(req)
    out, updated = step(sched, runner)
    (seq,) = out.seqs
    assert (seq.start_pos, len(seq.token_ids), seq.sample) == (0, 10, True)
    assert seq.history is req.all_token_ids  # no copy
    assert updated == [req] and req.num_output_tokens == 1
    out, _ = step(sched, runner)
    assert (out.seqs[0].start_pos, out.seqs[0].token_ids) == (10, [req.output_token_ids[0]])
    finished, _ = run_all(sched, runner)
    assert finished["a"].status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == expected_output(range(1, 11), 5)
    assert_all_freed(sched)


def test_chunked_prefill_runs_alongside_decodes():
    sched = make_sched(max_num_batched_tokens=16)
    runner = FakeRunner(200, 4)
    a = make_req("a", range(5), max_tokens=20)
    sched.add_request(a)
    step(sched, runner)  # a's prefill
    b = make_req("b", range(100, 140), max_tokens=3)  # 40 tokens: three chunks with a's decodes
    sched.add_request(b)
    chunks = []
    while b.num_output_tokens == 0:
        out, _ = step(sched, runner)
        assert out.seqs[0].req_id == "a" and len(out.seqs[0].token_ids) == 1  # the decode goes on
        sb = out.seqs[1]
        chunks.append((sb.start_pos, len(sb.token_ids), sb.sample))
    assert chunks == [(0, 15, False), (15, 15, False), (30, 10, True)]
    run_all(sched, runner)
    assert a.output_token_ids == expected_output(range(5), 20)
    assert b.output_token_ids == expected_output(range(100, 140), 3)
    assert_all_freed(sched)


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_sched(long_prefill_token_threshold=8)
    runner = FakeRunner(200, 4)
    sched.add_request(make_req("a", range(20), max_tokens=2))
    sizes = [len(step(sched, runner)[0].seqs[0].token_ids) for _ in range(4)]
    assert sizes == [8, 8, 4, 1]


def test_without_chunked_prefill_a_prompt_waits_for_room():
    sched = make_sched(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    runner = FakeRunner(200, 4)
    a = make_req("a", range(5), max_tokens=4)
    sched.add_request(a)
    step(sched, runner)
    b = make_req("b", range(100, 132 - 1), max_tokens=1)  # 31 tokens + a's decode = 32: fits
    c = make_req("c", range(200, 232), max_tokens=1)  # 32 tokens: must wait until the batch is empty
    sched.add_request(b)
    sched.add_request(c)
    out, _ = step(sched, runner)
    assert [(s.req_id, len(s.token_ids)) for s in out.seqs] == [("a", 1), ("b", 31)]
    sizes = []
    while not c.is_finished:
        out, _ = step(sched, runner)
        sizes.append([(s.req_id, len(s.token_ids)) for s in out.seqs])
    assert sizes[-1] == [("c", 32)] and all(len(ids) > 0 for ids in sizes)
    assert ("c", 32) not in sizes[0]
    with pytest.raises(ValueError, match="max-num-batched-tokens"):
        make_sched(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)


def test_max_num_seqs_respected():
    sched = make_sched(max_num_seqs=3)
    runner = FakeRunner(200, 4)
    for i in range(7):
        sched.add_request(make_req(f"r{i}", range(i, i + 6), max_tokens=4))
    out, _ = step(sched, runner)
    assert [s.req_id for s in out.seqs] == ["r0", "r1", "r2"] and sched.num_waiting == 4
    finished, _ = run_all(sched, runner)
    assert len(finished) == 7
    assert_all_freed(sched)


def test_budget_limits_decodes_too():
    sched = make_sched(max_num_seqs=8, max_num_batched_tokens=5)
    runner = FakeRunner(200, 4)
    for i in range(8):
        sched.add_request(make_req(f"r{i}", [i], max_tokens=3))
    out, _ = step(sched, runner)
    assert [s.req_id for s in out.seqs] == ["r0", "r1", "r2", "r3", "r4"]
    finished, _ = run_all(sched, runner)
    assert all(finished[f"r{i}"].output_token_ids == expected_output([i], 3) for i in range(8))


def test_prefix_cache_hit_reduces_scheduled_tokens():
    sched = make_sched()
    runner = FakeRunner(200, 4)
    system = list(range(1, 17))  # 4 full blocks
    a = make_req("a", system + [50, 51], max_tokens=3)
    sched.add_request(a)
    run_all(sched, runner)
    b = make_req("b", system + [60, 61, 62], max_tokens=3)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert (out.seqs[0].start_pos, len(out.seqs[0].token_ids)) == (16, 3)
    assert b.num_cached_tokens == 16
    # An identical prompt of whole blocks still recomputes its last block for the logits.
    c = make_req("c", system, max_tokens=2)
    sched.add_request(c)
    out, _ = step(sched, runner)
    seq_c = [s for s in out.seqs if s.req_id == "c"][0]
    assert (seq_c.start_pos, len(seq_c.token_ids), seq_c.sample) == (12, 4, True)
    run_all(sched, runner)
    assert b.output_token_ids == expected_output(system + [60, 61, 62], 3)
    assert c.output_token_ids == expected_output(system, 2)
    assert sched.prefix_cache_queries == 18 + 19 + 16 and sched.prefix_cache_hits == 16 + 12
    assert_all_freed(sched)


def test_generated_tokens_are_cached_for_a_follow_up_turn():
    sched = make_sched()
    runner = FakeRunner(200, 4)
    a = make_req("a", range(1, 7), max_tokens=10)
    sched.add_request(a)
    run_all(sched, runner)
    turn2 = a.all_token_ids + [90, 91]  # the whole first turn, then the user's reply
    b = make_req("b", turn2, max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, runner)
    # 15 of a's 16 tokens have KV (never the last sampled one): its 3 full blocks are reused.
    assert out.seqs[0].start_pos == 12 and b.num_cached_tokens == 12


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_and_output_is_unchanged(prefix_caching):
    prompts = {f"r{i}": list(range(i * 10, i * 10 + 7 + 3 * i)) for i in range(5)}

    def run(num_blocks):
        sched = make_sched(num_blocks=num_blocks, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
        runner = FakeRunner(num_blocks, 4)
        for rid, p in prompts.items():
            sched.add_request(make_req(rid, p, max_tokens=24))
        preempted = []
        finished, _ = run_all(sched, runner, on_step=lambda n, out: preempted.extend(out.preempted_req_ids))
        assert_all_freed(sched)
        return {rid: r.output_token_ids for rid, r in finished.items()}, preempted, sched

    roomy, preempted, _ = run(200)
    assert not preempted
    tight, preempted, sched = run(16)  # 15 usable blocks = 60 tokens for ~5 x 40 needed
    assert preempted and sched.num_preemptions == len(preempted)
    assert tight == roomy
    assert all(out == expected_output(prompts[rid], 24) for rid, out in tight.items())


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = make_sched(num_blocks=7, max_num_seqs=3)  # 6 usable blocks of 4
    runner = FakeRunner(7, 4)
    reqs = [make_req(f"r{i}", range(i * 10, i * 10 + 7), max_tokens=10) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, runner)  # each holds 2 blocks: the cache is full
    assert len(out.seqs) == 3
    out, _ = step(sched, runner)  # token 8 still fits in each one's second block
    assert not out.preempted_req_ids
    out, _ = step(sched, runner)  # r0 needs a third block: r2, the newest, is preempted
    assert out.preempted_req_ids == ["r2"] and [s.req_id for s in out.seqs] == ["r0", "r1"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert list(sched.waiting) == [reqs[2], reqs[3]]  # ahead of the one that never ran
    run_all(sched, runner)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 10) for r in reqs)


def test_request_longer_than_the_cache_stops_with_length():
    sched = make_sched(num_blocks=5, max_model_len=1000)  # 16 tokens of cache
    runner = FakeRunner(5, 4)
    req = make_req("a", range(10), max_tokens=100)
    sched.add_request(req)
    finished, _ = run_all(sched, runner)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 16
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(make_req("b", range(17)))
    with pytest.raises(ValueError, match="max_model_len"):
        make_sched(max_model_len=8).add_request(make_req("c", range(9)))


def test_finish_requests_frees_blocks():
    sched = make_sched(max_num_seqs=2)
    runner = FakeRunner(200, 4)
    reqs = [make_req(f"r{i}", range(i, i + 9), max_tokens=50) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    sched.finish_requests(["r0", "r2", "nope"], RequestStatus.FINISHED_ABORTED)  # running, waiting, unknown
    assert reqs[0].status == RequestStatus.FINISHED_ABORTED and reqs[2].is_finished
    assert sched.num_running == 1 and sched.num_waiting == 0
    assert sched.kv.num_held_blocks(reqs[0]) == 0
    # Aborted while its step runs: the result is dropped.
    out = sched.schedule()
    sched.finish_requests("r1", RequestStatus.FINISHED_STOPPED)
    assert sched.update_from_output(out, runner.execute(out)) == []
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    assert reqs[1].status == RequestStatus.FINISHED_STOPPED
    assert not sched.has_unfinished_requests()
    assert_all_freed(sched)


class ScriptedRunner:
    """Returns a fixed sequence of tokens, one per sampling row."""

    def __init__(self, tokens):
        self.tokens = iter(tokens)

    def execute(self, out):
        return ModelRunnerOutput([next(self.tokens) if s.sample else -1 for s in out.seqs])


def run_scripted(req, tokens, **kw):
    sched = make_sched(**kw)
    sched.add_request(req)
    run_all(sched, ScriptedRunner(tokens))
    assert_all_freed(sched)
    return req


@pytest.mark.parametrize(
    "params, eos, tokens, want_out, want_status, want_reason",
    [
        (dict(), (2,), [5, 6, 2, 7], [5, 6, 2], RequestStatus.FINISHED_STOPPED, None),
        (dict(ignore_eos=True, max_tokens=4), (2,), [5, 2, 2, 7], [5, 2, 2, 7], RequestStatus.FINISHED_LENGTH, None),
        (dict(stop_token_ids=[9]), (), [5, 9, 1], [5, 9], RequestStatus.FINISHED_STOPPED, 9),
        (dict(min_tokens=3, stop_token_ids=[9]), (2,), [2, 9, 9, 2], [2, 9, 9], RequestStatus.FINISHED_STOPPED, 9),
        (dict(min_tokens=3), (2,), [2, 2, 1, 2, 1], [2, 2, 1, 2], RequestStatus.FINISHED_STOPPED, None),
        (dict(max_tokens=3), (2,), [1, 1, 1, 1], [1, 1, 1], RequestStatus.FINISHED_LENGTH, None),
        # The last allowed token is EOS: "stop" says more than "length".
        (dict(max_tokens=2), (2,), [1, 2], [1, 2], RequestStatus.FINISHED_STOPPED, None),
    ],
)
def test_stop_conditions(params, eos, tokens, want_out, want_status, want_reason):
    params.setdefault("max_tokens", 16)
    req = run_scripted(make_req("a", [3, 3, 3], eos=eos, **params), tokens)
    assert (req.output_token_ids, req.status, req.stop_reason) == (want_out, want_status, want_reason)


def test_max_model_len_stops():
    req = run_scripted(make_req("a", range(10), max_tokens=None), [1] * 100, max_model_len=14)
    assert req.num_tokens == 14 and req.status == RequestStatus.FINISHED_LENGTH


def test_reset_prefix_cache():
    sched = make_sched()
    runner = FakeRunner(200, 4)
    sched.add_request(make_req("a", range(20), max_tokens=1))
    run_all(sched, runner)
    assert sched.reset_prefix_cache()
    b = make_req("b", range(20), max_tokens=1)
    sched.add_request(b)
    run_all(sched, runner)
    assert b.num_cached_tokens == 0


def stress_sched(seed, rng, max_model_len=96):
    """A scheduler with limits drawn from ``rng``: small budgets, tight caches, chunked or not."""
    chunked = seed % 3 != 2
    return make_sched(
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([16, 48]) if chunked else max_model_len,
        max_model_len=max_model_len,
        num_blocks=rng.choice([26, 40, 400]),  # 25 usable blocks = 100 tokens: one max-length request
        enable_chunked_prefill=chunked,
        enable_prefix_caching=seed % 2 == 0,
        long_prefill_token_threshold=rng.choice([0, 0, 12]),
    )


def drive_with_arrivals(sched, pending, wanted, rng, run, abort_phase=(7, 3)):
    """Feed ``pending`` requests in while ``run(on_step)`` steps the scheduler, with an occasional abort
    (dropped from ``wanted``); returns every finished request by id."""

    def join(n, out):
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if n % abort_phase[0] == abort_phase[1] and sched.running and rng.random() < 0.3:
            victim = rng.choice(sched.running).request_id
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            wanted.pop(victim)

    for _ in range(4):
        sched.add_request(pending.pop(0))
    finished = {}
    while sched.has_unfinished_requests() or pending:
        finished.update(run(join))
        if pending:
            sched.add_request(pending.pop(0))
    return finished


@pytest.mark.parametrize("seed", range(8))
def test_stress_nothing_accepted_is_lost(seed):
    rng = random.Random(seed)
    max_model_len = 96
    sched = stress_sched(seed, rng, max_model_len)
    runner = FakeRunner(sched.kv.num_blocks, 4)
    shared = [rng.randrange(VOCAB) for _ in range(24)]  # a common prefix, for prefix hits
    wanted = {}
    pending = []
    for i in range(60):
        n = rng.randint(1, 60)
        prompt = (shared[: rng.randint(0, 24)] + [rng.randrange(VOCAB) for _ in range(n)])[:80]
        max_tokens = rng.randint(1, 30)
        pending.append(make_req(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
        wanted[f"r{i}"] = expected_output(prompt, min(max_tokens, max_model_len - len(prompt)))

    finished = drive_with_arrivals(sched, pending, wanted, rng, lambda on_step: run_all(sched, runner, on_step=on_step)[0])
    assert set(finished) == set(wanted)
    for rid, req in finished.items():
        assert req.output_token_ids == wanted[rid], rid
        assert req.status == RequestStatus.FINISHED_LENGTH
    assert_all_freed(sched)

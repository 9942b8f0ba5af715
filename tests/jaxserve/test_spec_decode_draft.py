"""Draft-model speculation on tiny checkpoints: greedy output equals the plain engine's token for token (the
plain engine equals HF greedy: test_engine_parity), and the draft's KV cache stays consistent after rejections.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from engine_fixtures import (
    _ROOT, check_priming_writes_no_kv, checkpoint, completions, fresh_compiles, generate, small_engine_kwargs,
    speculative_engine,
)
from tiny_models import make_tiny_checkpoint

from jaxserve import LLM, SamplingParams

K = 3


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


@pytest.fixture(scope="module")
def llm():
    # The target as its own draft: every greedy proposal is right. 28 blocks of 4: preemption under load.
    spec = {"method": "draft_model", "model": checkpoint("llama_gqa"), "num_speculative_tokens": K}
    return speculative_engine(spec, num_gpu_blocks_override=28)


def _run_exact(llm):
    shared = _ids(10, 7)
    prompts = [{"prompt_token_ids": shared + _ids(3 + i, 20 + i)} for i in range(4)]
    prompts.append({"prompt_token_ids": _ids(40, 40)})  # 40 > the 32-token budget: chunked prefill
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (28, 9, 21, 14, 17)]
    plain = completions(generate(llm, prompts, params, speculate=False))
    engine = llm.llm_engine
    preempted, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    assert completions(generate(llm, prompts, params)) == plain
    assert engine.scheduler.num_preemptions > preempted and engine.scheduler.prefix_cache_hits > hits


def test_draft_equal_to_target_accepts_everything_and_is_exact(llm):
    spec = llm.llm_engine.speculator
    fed, device_fed, stats = spec.num_fed_rounds, spec.num_device_fed_steps, spec.stats
    _run_exact(llm)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert spec.num_fed_rounds > fed  # rounds dispatched behind the verify step (spec_decode.fed_rounds)
    assert spec.num_device_fed_steps > device_fed  # verify steps that read those proposals on the device


def test_greedy_exact_when_proposals_are_rejected(llm):
    """Corrupt one proposal of most drafts after the draft made them (its cache holds the real ones): the target
    rejects there, the draft must carry on from a cache that is right only up to the accepted tokens. Proposals
    a fed round left on the device are read first (``materialize``), so that they can be corrupted too."""
    spec = llm.llm_engine.speculator
    propose, calls = spec.propose, [0]

    def corrupting(running, kv):
        propose(running, kv)
        spec.materialize()
        for r in running:
            calls[0] += 1
            if r.spec_token_ids and calls[0] % 4:
                r.spec_token_ids[calls[0] % len(r.spec_token_ids)] ^= 1

    stats = spec.stats
    rejected = stats.num_draft_tokens - stats.num_accepted_tokens
    spec.propose = corrupting
    try:
        _run_exact(llm)
    finally:
        del spec.propose
    assert stats.num_draft_tokens - stats.num_accepted_tokens > rejected + 10


def test_draft_cache_consistent_after_rejections(llm):
    """Sampled rows reject proposals often; after every step, the draft's incremental proposals must equal
    those it makes from an empty draft cache (recomputing every position)."""
    engine = llm.llm_engine
    draft = engine.speculator.draft
    sp = SamplingParams(temperature=1.5, seed=1, max_tokens=24, ignore_eos=True)
    for i, n in enumerate((6, 11)):
        engine.add_request(f"c{i}", {"prompt_token_ids": _ids(n, 30 + i)}, sp)
    compared = 0
    rejected_before = engine.speculator.stats.num_draft_tokens - engine.speculator.stats.num_accepted_tokens
    while engine.has_unfinished_requests():
        engine.step()
        engine.speculator.materialize()  # proposals a fed round left on the device, as values
        running = [r for r in engine.scheduler.running if r.spec_token_ids]
        incremental = {r.request_id: list(r.spec_token_ids) for r in running}
        draft._states.clear()  # forget what the draft cache holds: recompute from position 0
        draft.propose(running, K, engine.scheduler.kv)
        assert {r.request_id: r.spec_token_ids for r in running} == incremental
        compared += len(running)
    stats = engine.speculator.stats
    assert compared > 5 and stats.num_draft_tokens - stats.num_accepted_tokens > rejected_before
    assert engine.speculator.num_fed_rounds > 0


def test_draft_with_another_vocabulary_is_refused():
    path = os.path.join(_ROOT, "llama_vocab_600")
    if not os.path.exists(path):
        make_tiny_checkpoint(path, "llama", vocab_size=600)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"vocab_size=600.*vocab_size=512.*share the target's tokenizer"):
        LLM(checkpoint("llama_gqa"), **small_engine_kwargs(speculative_config=spec, precompile="none"))


def test_round_programs_are_stored_and_loaded(llm, tmp_path, monkeypatch):
    """A second start loads the draft's round programs (its own and the fed ones) that an earlier start compiled
    (the draft runner's executable store, which on accelerators persists between starts; opened here on CPU too),
    and greedy output is the plain engine's; the programs of another k are not loaded."""
    from jaxserve import executable_store
    from jaxserve.spec_decode.draft_program import DraftPrograms, RoundPrograms
    from jaxserve.spec_decode.fed_rounds import FedPrograms

    monkeypatch.setattr(executable_store.ExecutableStore, "open",
                        classmethod(lambda cls, cache_dir, platform, context: cls(str(tmp_path), context)))
    # One start-up shape (the single stream's: 4 tokens, the shortest width), so that the test compiles little.
    monkeypatch.setattr(RoundPrograms, "shapes", lambda self: [(4, self.runner.width_buckets[0])])
    draft = llm.llm_engine.speculator.draft

    def start(k):
        programs = DraftPrograms(draft.runner, k)
        fed = FedPrograms(programs, k)
        programs.warmup()
        fed.warmup()
        return programs, fed

    with fresh_compiles():  # the cold start compiles what it stores, as on a fresh machine
        cold, warm = start(K), start(K)
    assert [p.num_loaded_programs for p in cold] == [0, 0] and [p.num_loaded_programs for p in warm] == [1, 1]
    assert len(list(tmp_path.glob("draft-k3-*.jxe"))) == len(list(tmp_path.glob("draft-fed-k3-*.jxe"))) == 1
    prompts = [{"prompt_token_ids": _ids(3, 3)}]  # every round of 1..4 tokens: the stored programs
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    plain = completions(generate(llm, prompts, params, speculate=False))
    saved, (draft.programs, draft.fed) = (draft.programs, draft.fed), warm
    fed_rounds = llm.llm_engine.speculator.num_fed_rounds
    try:
        assert completions(generate(llm, prompts, params)) == plain
    finally:
        draft.programs, draft.fed = saved
    assert llm.llm_engine.speculator.num_fed_rounds > fed_rounds
    assert warm[0].num_lazy_compiles == warm[1].num_lazy_compiles == 0  # only the loaded programs ran
    # Another k is another program: not served the stored one (its warm-up would compile and store its own).
    other = DraftPrograms(draft.runner, K + 1)
    shape = other.shapes()[0]
    assert draft.runner._executable_store().load(warm[0]._store_name(shape), jax.devices()[:1]) is not None
    assert draft.runner._executable_store().load(other._store_name(shape), jax.devices()[:1]) is None


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
def test_tensor_parallel_reads_fed_proposals_on_the_device(llm):
    """tensor_parallel_size=2: the draft and target sharded, rounds fed by the verify step, and the next verify
    step reading their proposals on the device; greedy tokens equal the TP=1 plain engine's."""
    spec = {"method": "draft_model", "model": checkpoint("llama_gqa"), "num_speculative_tokens": K}
    tp2 = speculative_engine(spec, tensor_parallel_size=2)
    prompts = [{"prompt_token_ids": _ids(7 + i, 60 + i)} for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert completions(generate(tp2, prompts, params)) == completions(generate(llm, prompts, params, speculate=False))
    assert tp2.llm_engine.speculator.num_device_fed_steps > 0


def test_sampled_rows_equal_whether_proposals_are_read_on_the_device_or_not(llm):
    """Seeded sampled rows: the verify step's rejection sampling sees the same proposals whether it read them on
    the device (a fed round's, unread by the host) or from the host, so the tokens are the same."""
    spec = llm.llm_engine.speculator
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=14, ignore_eos=True) for s in (3, 4)]
    prompts = [{"prompt_token_ids": _ids(8 + i, 70 + i)} for i in range(2)]
    device_fed = spec.num_device_fed_steps
    on_device = completions(generate(llm, prompts, sp))
    assert spec.num_device_fed_steps > device_fed
    spec.draft.device_fed_verify = False  # read every fed round's proposals before the next verify step
    try:
        device_fed = spec.num_device_fed_steps
        assert completions(generate(llm, prompts, sp)) == on_device
        assert spec.num_device_fed_steps == device_fed
    finally:
        del spec.draft.device_fed_verify


def test_abort_while_proposals_wait_on_the_device(llm):
    """A request aborted while it holds placeholder proposals (the next verify step was to read them on the
    device): the others carry on, token for token as the plain engine."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": _ids(6 + i, 80 + i)} for i in range(3)]
    plain = completions(generate(llm, prompts[1:], sp, speculate=False))
    for i, p in enumerate(prompts):
        engine.add_request(f"ab{i}", p, sp)
    steps = 0
    while engine.speculator._claimed is None:
        engine.step()
        steps += 1
        assert steps < 20, "no fed round's proposals were left on the device"
    assert "ab0" in engine.speculator._claimed.claimed
    engine.abort_request("ab0")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert "ab0" not in done
    assert [[(c.token_ids, c.text, c.finish_reason) for c in done[f"ab{i}"].outputs] for i in (1, 2)] == plain


def test_priming_writes_no_kv(llm, monkeypatch):
    prompts = [{"prompt_token_ids": _ids(9, 60 + i)} for i in range(2)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    check_priming_writes_no_kv(llm, monkeypatch, prompts, params)

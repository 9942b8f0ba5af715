"""Draft-model speculation on tiny checkpoints: greedy output equals the plain engine's token for token (the
plain engine equals HF greedy: test_engine_parity), and the draft's KV cache stays consistent after rejections.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_fixtures import _ROOT, checkpoint, small_engine_kwargs
from tiny_models import make_tiny_checkpoint

from jaxserve import LLM, SamplingParams

K = 3


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def _engine(draft_variant, **kw):
    spec = {"method": "draft_model", "model": checkpoint(draft_variant), "num_speculative_tokens": K}
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs(speculative_config=spec, precompile="none", **kw))


def _generate(llm, prompts, params, speculate=True):
    engine = llm.llm_engine
    saved = engine.speculator
    engine.speculator = saved if speculate else None
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    finally:
        engine.speculator = saved


@pytest.fixture(scope="module")
def same_draft():
    return _engine("llama_gqa")  # the target as its own draft: every greedy proposal is right


def test_draft_equal_to_target_accepts_everything_and_is_exact(same_draft):
    prompts = [{"prompt_token_ids": _ids(n, n)} for n in (5, 40, 13)]  # 40 > the 32-token budget: chunked
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 9, 14)]
    plain = _generate(same_draft, prompts, params, speculate=False)
    stats = same_draft.llm_engine.speculator.stats
    assert _generate(same_draft, prompts, params) == plain
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_draft_cache_consistent_after_rejections(same_draft):
    """Sampled rows reject proposals often; after every step, the draft's incremental proposals must equal
    those it makes from an empty draft cache (recomputing every position)."""
    engine = same_draft.llm_engine
    draft = engine.speculator.draft
    sp = SamplingParams(temperature=1.5, seed=1, max_tokens=24, ignore_eos=True)
    for i, n in enumerate((6, 11)):
        engine.add_request(f"c{i}", {"prompt_token_ids": _ids(n, 30 + i)}, sp)
    compared = 0
    rejected_before = engine.speculator.stats.num_draft_tokens - engine.speculator.stats.num_accepted_tokens
    while engine.has_unfinished_requests():
        engine.step()
        running = [r for r in engine.scheduler.running if r.spec_token_ids]
        incremental = {r.request_id: list(r.spec_token_ids) for r in running}
        draft._states.clear()  # forget what the draft cache holds: recompute from position 0
        draft.propose(running, K, engine.scheduler.kv)
        assert {r.request_id: r.spec_token_ids for r in running} == incremental
        compared += len(running)
    stats = engine.speculator.stats
    assert compared > 5 and stats.num_draft_tokens - stats.num_accepted_tokens > rejected_before


def test_other_draft_with_preemption_and_prefix_cache():
    llm = _engine("llama_mha_tied", num_gpu_blocks_override=40)
    shared = _ids(10, 7)
    prompts = [{"prompt_token_ids": shared + _ids(3 + i, 20 + i)} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    plain = _generate(llm, prompts, params, speculate=False)
    engine = llm.llm_engine
    preempted, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    assert _generate(llm, prompts, params) == plain
    assert engine.scheduler.num_preemptions > preempted and engine.scheduler.prefix_cache_hits > hits
    assert engine.speculator.stats.num_draft_tokens > 0


def test_draft_with_another_vocabulary_is_refused():
    path = os.path.join(_ROOT, "llama_vocab_600")
    if not os.path.exists(path):
        make_tiny_checkpoint(path, "llama", vocab_size=600)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"vocab_size=600.*vocab_size=512.*share the target's tokenizer"):
        LLM(checkpoint("llama_gqa"), **small_engine_kwargs(speculative_config=spec, precompile="none"))

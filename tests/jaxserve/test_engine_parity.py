"""Greedy output equals HF transformers (fp32) token for token, through every scheduler path."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import VARIANTS, hf_greedy

from jaxserve import LLM, SamplingParams

PROMPT_LENS = (1, 3, 7, 16, 33, 50)
MAX_TOKENS = 12


def _prompts(seed: int, lens=PROMPT_LENS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 500, size=n).tolist() for n in lens]


def _generate(llm: LLM, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_greedy_matches_hf(variant):
    """Ragged batch of varied prompt lengths, chunked prefill (budget 32 < longest prompt)."""
    path = checkpoint(variant)
    llm = LLM(path, **small_engine_kwargs())
    prompts = _prompts(0)
    got = _generate(llm, prompts)
    for p, g in zip(prompts, got):
        assert g == hf_greedy(path, p, MAX_TOKENS), f"prompt of {len(p)} tokens"


def test_alone_equals_batched_and_requests_join_midflight():
    path = checkpoint("llama_gqa")
    llm = LLM(path, **small_engine_kwargs())
    prompts = _prompts(1)
    alone = [_generate(llm, [p])[0] for p in prompts]
    # Requests joining while others decode: add two, step a few times, add the rest.
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    finals = {}
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for i, p in enumerate(prompts[2:], start=2):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    joined = [finals[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    assert joined == alone
    assert alone == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


def test_prefix_cache_hits_keep_output():
    path = checkpoint("llama_gqa")
    llm = LLM(path, **small_engine_kwargs())
    rng = np.random.default_rng(2)
    prefix = rng.integers(2, 500, size=40).tolist()
    prompts = [prefix + rng.integers(2, 500, size=n).tolist() for n in (1, 5, 9)]
    first = _generate(llm, prompts[:1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert all(o.num_cached_tokens >= 36 for o in outs), [o.num_cached_tokens for o in outs]
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == first[0]
    assert got == [hf_greedy(path, p, MAX_TOKENS) for p in prompts]


def test_preemption_keeps_greedy_output():
    """A KV cache of 40 blocks x 4 slots cannot hold six 50+-token sequences at once: preemption must kick in."""
    path = checkpoint("llama_gqa")
    llm = LLM(path, **small_engine_kwargs(num_gpu_blocks_override=40, enable_prefix_caching=False))
    prompts = _prompts(3, lens=(30, 41, 26, 50, 37, 45))
    got = _generate(llm, prompts, max_tokens=20)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert got == [hf_greedy(path, p, 20) for p in prompts]


def test_no_chunked_prefill_and_eager_mode_agree():
    path = checkpoint("qwen3_qknorm")
    prompts = _prompts(4, lens=(5, 20, 47))
    want = [hf_greedy(path, p, 6) for p in prompts]
    llm = LLM(path, **small_engine_kwargs(enable_chunked_prefill=False, max_num_batched_tokens=128))
    assert _generate(llm, prompts, 6) == want
    eager = LLM(path, **small_engine_kwargs(enforce_eager=True))
    before = jax.tree.leaves(eager.llm_engine.runner.kv_caches)
    assert _generate(eager, prompts, 6) == want
    # Eager attention takes each layer's pages as donated buffers: the KV write reuses them instead of
    # copying the layer while the runner still holds the old pages (the cache twice over, by a step's end).
    assert all(a.is_deleted() for a in before)

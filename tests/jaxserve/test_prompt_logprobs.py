"""SamplingParams.prompt_logprobs: each prompt token's logprob equals HF transformers' (fp32), through chunked
prefill, prefix caching, preemption, n > 1, eager mode and TP / DP, without changing what is generated."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch
from engine_fixtures import checkpoint, small_engine_kwargs
from transformers import AutoModelForCausalLM

from jaxserve import LLM, SamplingParams

PROMPT_LENS = (1, 2, 9, 40, 70)  # 40 and 70 > the 32-token budget: chunked prefill, chunks end mid-prompt
K = 3


def _prompts(lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 500, size=n).tolist() for n in lens]


@functools.lru_cache(maxsize=None)
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _hf_logprobs(path: str, prompt: list[int]) -> np.ndarray:
    """[len - 1, V]: row i is the distribution of prompt token i + 1."""
    with torch.no_grad():
        logits = _hf(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()[:-1]


def _run(llm: LLM, prompts, k: int = K, **params) -> list:
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "prompt_logprobs": k, **params})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _as_arrays(plp) -> list[tuple[int, float, int, list[int]]]:
    """Per position after the first: (prompt token, its logprob, its rank, the top ids by rank)."""
    out = []
    for entry in plp[1:]:
        token, first = next(iter(entry.items()))
        top = [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= K and (t != token or first.rank <= K)]
        out.append((token, first.logprob, first.rank, top))
    return out


def _assert_same(a, b, atol=1e-5):
    assert len(a) == len(b)
    for (t1, lp1, r1, top1), (t2, lp2, r2, top2) in zip(_as_arrays(a), _as_arrays(b)):
        assert (t1, r1, top1) == (t2, r2, top2)
        assert abs(lp1 - lp2) <= atol


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs())


@pytest.fixture(scope="module")
def reference(llm):
    """The prompt logprobs of each prompt, computed alone by the default engine."""
    return [_run(llm, [p])[0].prompt_logprobs for p in _prompts()]


def test_prompt_logprobs_match_hf(llm):
    path = checkpoint("llama_gqa")
    prompts = _prompts()
    outs = _run(llm, prompts)
    for p, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(p) and plp[0] is None
        if len(p) == 1:
            continue
        ref = _hf_logprobs(path, p)
        for i, entry in enumerate(plp[1:]):
            token = p[i + 1]
            assert next(iter(entry)) == token  # the prompt token first, as vLLM lists it
            assert entry[token].logprob == pytest.approx(float(ref[i, token]), abs=1e-4)
            assert entry[token].rank == 1 + int((ref[i] > ref[i, token]).sum())
            assert set(np.argsort(-ref[i])[:K].tolist()) <= set(entry)
            assert len(entry) <= K + 1
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(float(ref[i, t]), abs=1e-4)


def test_generated_tokens_unchanged(llm):
    prompts = _prompts()
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=4),
                         use_tqdm=False)
    with_plp = _run(llm, prompts)
    assert [o.outputs[0].token_ids for o in with_plp] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_scoring_a_generated_token_gives_its_sampled_logprob(llm):
    prompt = _prompts()[3]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=3, logprobs=0)
    gen = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
    scored = _run(llm, [prompt + gen.token_ids], k=0, max_tokens=1)[0].prompt_logprobs
    for j, token in enumerate(gen.token_ids):
        assert scored[len(prompt) + j][token].logprob == pytest.approx(gen.logprobs[j][token].logprob, abs=1e-5)
        assert scored[len(prompt) + j][token].rank == gen.logprobs[j][token].rank


def test_batched_equals_alone_and_k_zero(llm, reference):
    for out, ref in zip(_run(llm, _prompts()), reference):
        _assert_same(out.prompt_logprobs, ref)
    zero = _run(llm, _prompts()[3:4], k=0)[0].prompt_logprobs
    assert all(len(e) == 1 for e in zero[1:])  # the prompt token alone


def test_prefix_cache_is_bypassed_until_complete(reference):
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(enable_prefix_caching=True))
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in first)
    outs = _run(llm, prompts)  # every prompt's blocks are cached now
    for out, ref in zip(outs, reference):
        assert out.num_cached_tokens == 0
        _assert_same(out.prompt_logprobs, ref)
    again = llm.generate([{"prompt_token_ids": prompts[-1]}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # without prompt logprobs the cache serves as before


def test_preemption_keeps_them_whole(reference):
    # 24 blocks of 4 tokens for five prompts of up to 70 + 4 tokens: requests are preempted and recomputed.
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(num_gpu_blocks_override=24, enable_prefix_caching=True))
    outs = _run(llm, _prompts())
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for out, ref in zip(outs, reference):
        _assert_same(out.prompt_logprobs, ref)


def test_n_samples_share_one_list(llm, reference):
    out = _run(llm, [_prompts()[3]], n=3, temperature=1.0, seed=7)[0]
    assert len(out.outputs) == 3
    _assert_same(out.prompt_logprobs, reference[3])


def test_eager_mode(reference):
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(enforce_eager=True))
    for out, ref in zip(_run(llm, _prompts()[2:4]), reference[2:4]):
        _assert_same(out.prompt_logprobs, ref)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "dp2"])  # DP x TP itself: test_tp_dp
def test_tensor_and_data_parallel(reference, tp, dp):
    llm = LLM(checkpoint("llama_gqa"), tensor_parallel_size=tp, data_parallel_size=dp, **small_engine_kwargs())
    try:
        for out, ref in zip(_run(llm, _prompts()), reference):
            _assert_same(out.prompt_logprobs, ref, atol=1e-4)
    finally:
        if dp > 1:
            llm.llm_engine.close()


def test_bad_values_are_named(llm):
    with pytest.raises(ValueError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    small = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(max_logprobs=2))
    with pytest.raises(ValueError, match="exceeds max_logprobs=2"):
        small.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(prompt_logprobs=3), use_tqdm=False)


def test_refused_with_speculative_decoding():
    from engine_fixtures import speculative_engine

    llm = speculative_engine({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with speculative decoding"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(prompt_logprobs=1), use_tqdm=False)


def test_rows_overwrite_and_the_build_leaves_gc_as_it_was():
    """Host side alone: a chunk stored twice (recompute) overwrites its rows; the dicts put the prompt token first
    with its own rank, then the top-k by place; the garbage collector is paused only while they are built."""
    import gc

    from jaxserve.outputs import Logprob
    from jaxserve.prompt_logprobs import PromptLogprobs, Rows, as_list

    k, t = 2, 4
    step = PromptLogprobs(np.arange(t, dtype=np.float32) - 9, np.array([3, 1, 2, 1], np.int32),
                          np.array([[7, 8, 9]] * t, np.int32), np.full((t, 3), -0.5, np.float32))
    rows = Rows(num_prompt_tokens=5, k=k)  # positions 1..4
    rows.put(1, step, slice(0, 2))
    assert not rows.complete and rows.num_filled == 2
    rows.put(1, step, slice(0, 2))  # the same chunk again
    assert rows.num_filled == 2
    rows.put(3, step, slice(2, 4))
    assert rows.complete

    def entry(token, lp, rank, top_ids, top_lps):
        return {token: Logprob(lp, rank), **{i: Logprob(v, p) for p, (i, v) in enumerate(zip(top_ids, top_lps), 1)
                                            if i != token}}

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            out = as_list([1, 5, 8, 6, 7], rows, entry)
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    assert out[0] is None and len(out) == 5
    assert list(out[1]) == [5, 7, 8] and out[1][5] == Logprob(-9.0, 3) and out[1][8] == Logprob(-0.5, 2)
    assert list(out[2]) == [8, 7] and out[2][8].rank == 1  # the prompt token keeps its own rank

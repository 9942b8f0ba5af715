"""SamplingParams.logit_bias (OpenAI's logit_bias): added to the logits before sampling, in the sampler, the
engine (also under speculative decoding) and the server through the official `openai` client."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, generate, small_engine_kwargs, speculative_engine
from test_sampler import DRAWS, draw_many, logits_like, seq, softmax

from jaxserve import LLM, SamplingParams
from jaxserve.sampler import sample
from jaxserve.sampling_metadata import SamplingMetadata


def test_bad_biases_are_named():
    for bias, want in [({-1: 1.0}, "keys must be token ids"), ({"5": 1.0}, "keys must be token ids"),
                       ({5: 101.0}, r"\[-100, 100\]"), ({5: "x"}, r"\[-100, 100\]"), ([5], "must be a dict"),
                       ({i: 1.0 for i in range(301)}, "at most 300")]:  # fmt: skip
        with pytest.raises(ValueError, match="SamplingParams.logit_bias=.*" + want):
            SamplingParams(logit_bias=bias)


def test_greedy_rows_take_the_biased_argmax_and_logprobs_stay_raw():
    logits = logits_like(3)
    best = logits.argmax(-1)
    forced = int(np.argmin(logits[0]))
    seqs = [seq(SamplingParams(temperature=0, logit_bias={forced: 100.0}, logprobs=1)),
            seq(SamplingParams(temperature=0, logit_bias={int(best[1]): -100.0})),
            seq(SamplingParams(temperature=0))]  # fmt: skip
    md = SamplingMetadata.from_seqs(seqs, 4)
    assert md.needs_bias and md.bias_ids.shape == (4, 16) and not md.plain_greedy
    out = jax.jit(sample)(jnp.asarray(np.pad(logits, ((0, 1), (0, 0)))), md)
    tokens = np.asarray(out.token_ids)
    assert tokens[0] == forced
    assert tokens[1] == np.argsort(-logits[1])[1]  # the best is banned: the second best
    assert tokens[2] == best[2]  # a row without a bias is untouched
    raw = logits[0] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert float(out.sampled_logprobs[0]) == pytest.approx(raw[forced], abs=1e-4)  # the model's, not the biased


def test_sampled_rows_draw_from_the_biased_distribution():
    logits = logits_like(1, scale=1.0)[0]
    bias = {3: 2.0, 7: -100.0}
    counts = np.bincount(draw_many(logits, SamplingParams(temperature=1.0, logit_bias=bias)), minlength=len(logits))
    biased = logits.copy()
    for t, b in bias.items():
        biased[t] += b
    expected = softmax(biased) * DRAWS
    assert counts[7] == 0
    assert abs(counts[3] - expected[3]) < 5 * np.sqrt(expected[3])  # a 5-sigma band: fails ~1 run in 10^6


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs())


def _greedy(llm, prompts, bias=None, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=6, logit_bias=bias, **kw)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


def test_engine_applies_it_per_request(llm):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = _greedy(llm, prompts)
    assert _greedy(llm, prompts, {123: 100.0}) == [[123] * 6] * 2
    assert _greedy(llm, prompts, {123: 0.0}) == plain
    banned = _greedy(llm, prompts[:1], {plain[0][0]: -100.0})[0]
    assert banned[0] != plain[0][0]
    # One biased request beside an unbiased one: the other's tokens are its own.
    sp = [SamplingParams(temperature=0.0, max_tokens=6, logit_bias={123: 100.0}), SamplingParams(temperature=0.0, max_tokens=6)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[123] * 6, plain[1]]
    with pytest.raises(ValueError, match="token id 100000 is outside the vocabulary"):
        _greedy(llm, prompts, {100000: 1.0})


def test_speculative_decoding_keeps_greedy_with_a_bias_exact():
    """Greedy rows with a bias take the sampler's path in the verify step (test_spec_decode_rejection checks sampled
    rows' distribution under a bias)."""
    llm = speculative_engine({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 10, 11, 9, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={7: 1.0, 79: -100.0})
    spec = generate(llm, prompts, params)
    plain = generate(llm, prompts, params, speculate=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all(79 not in o.outputs[0].token_ids for o in spec)
    assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0

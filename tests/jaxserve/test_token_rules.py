"""allowed_token_ids and bad_words (vLLM's SamplingParams fields, jaxserve.token_rules): the rules themselves, and
the engine's outputs obeying them on every path a request can take (chunked prefill, prefix caching, preemption,
n > 1, beside a grammar, TP, DP and speculative decoding). The server's side is in tests/server."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, generate, small_engine_kwargs, speculative_engine

from jaxserve import LLM, SamplingParams
from jaxserve.token_rules import TokenRules, _bits, bad_word_sequences

PROMPTS = ["The capital of France is", "My phone number is", "x" * 60]  # the last one spans chunks (budget 32)


def _allowed_row(ids, words=4):
    return _bits(ids, words)


def _set_bits(row: np.ndarray) -> list[int]:
    return [t for t in range(row.size * 32) if (int(row[t >> 5]) >> (t & 31)) & 1]


def test_rules_mask_rows():
    ids = [0, 5, 31, 32, 63, 127]  # bit 31 is an int32 word's sign bit
    rules = TokenRules(_allowed_row(ids), ((7,), (3, 31), (1, 2, 63)))
    row = np.full(4, -1, np.int32)
    rules.apply(row)
    assert _set_bits(row) == ids  # 7 is not allowed anyway; no sequence's prefix has been generated
    every = TokenRules(None, ((3, 31), (1, 2, 63), (9,)))
    for taken, banned in [([], [9]), ([3], [9, 31]), ([3, 1], [9]), ([1, 2], [9, 63]), ([2, 3], [9, 31])]:
        rules = every.copy()
        for t in taken:
            rules.accept(t)
        row = np.full(4, -1, np.int32)
        rules.apply(row)
        assert sorted(set(range(128)) - set(_set_bits(row))) == banned, taken
    twin = every.copy()
    twin.accept(3)
    assert every._tail == [] and twin._tail == [3]  # a copy walks on its own (n > 1)


def test_bad_word_sequences(llm):
    tok = llm.get_tokenizer()
    seqs = bad_word_sequences(["France", " capital"], tok)
    for word in ("France", "capital"):
        plain = tuple(tok.encode(word, add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word, add_special_tokens=False))
        assert plain in seqs
        # the spaced form too, unless it is only a space token before the plain one (which would ban every space)
        assert (spaced in seqs) != (spaced[1:] == plain)
    assert len(seqs) == len(set(seqs))


def test_bad_values_are_named():
    for value in ([], [-1], ["3"], [True], 5):
        with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids=.*non-empty list of token ids"):
            SamplingParams(allowed_token_ids=value)
    for value in ([""], ["  "], [3], 3):
        with pytest.raises(ValueError, match="SamplingParams.bad_words=.*non-blank strings"):
            SamplingParams(bad_words=value)
    assert SamplingParams(bad_words="Paris").bad_words == ["Paris"]


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs())


def _allowed_ids(llm) -> list[int]:
    tok = llm.get_tokenizer()
    return sorted({tok.encode(w, add_special_tokens=False)[0] for w in ("a", "b", "c", "d", "e")})


def _contains(tokens, seq) -> bool:
    n = len(seq)
    return any(tuple(tokens[i : i + n]) == tuple(seq) for i in range(len(tokens) - n + 1))


def _bad_word(llm, plain_outputs) -> str:
    """A word of several tokens that the first plain greedy output writes (as the tokenizer would spell it)."""
    tok = llm.get_tokenizer()
    tokens = plain_outputs[0].outputs[0].token_ids
    for n in (3, 2):
        for i in range(1, len(tokens) - n):
            word = tok.decode(tokens[i : i + n]).strip()
            seqs = bad_word_sequences([word], tok) if word else ()
            if any(len(s) > 1 and _contains(tokens, s) for s in seqs):
                return word
    raise AssertionError(f"no word of several tokens in {tokens}")


def _check(llm, outs, allowed=None, bad=None) -> None:
    seqs = bad_word_sequences([bad], llm.get_tokenizer()) if bad else ()
    for out in outs:
        for c in out.outputs:
            if allowed is not None:
                assert set(c.token_ids) <= set(allowed), c.token_ids
            for s in seqs:
                assert not _contains(c.token_ids, s), (bad, c.token_ids)


def test_allowed_token_ids_greedy_sampled_and_n(llm):
    allowed = _allowed_ids(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    _check(llm, outs, allowed=allowed)
    # greedy takes the model's best among the allowed: the token a +100 logit_bias on them makes the argmax
    biased = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                  logit_bias={i: 100.0 for i in allowed}), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in biased]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)  # no end-of-sequence token was allowed
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12,
                                                   allowed_token_ids=allowed[:2]), use_tqdm=False)
    _check(llm, sampled, allowed=allowed[:2])
    assert len({tuple(c.token_ids) for o in sampled for c in o.outputs}) > 1


def test_bad_words_greedy_and_beside_plain_requests(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = llm.generate(PROMPTS, plain, use_tqdm=False)
    bad = _bad_word(llm, want)
    seqs = bad_word_sequences([bad], llm.get_tokenizer())
    assert any(_contains(want[0].outputs[0].token_ids, s) for s in seqs)  # the plain output writes the word
    params = [plain.clone(bad_words=[bad]), plain, plain.clone(bad_words=[bad])]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    _check(llm, [outs[0], outs[2]], bad=bad)
    assert outs[1].outputs[0].token_ids == want[1].outputs[0].token_ids  # the plain request beside them
    first = want[0].outputs[0].token_ids
    got = outs[0].outputs[0].token_ids
    cut = min(i for s in seqs for i in range(len(first)) if tuple(first[i : i + len(s)]) == s)
    assert got[:cut] == first[:cut]  # the same until the word would begin, then something else


def test_rules_beside_a_grammar(llm):
    allowed = _allowed_ids(llm)
    tok = llm.get_tokenizer()
    words = [tok.decode([t]) for t in allowed]
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": words},
                        allowed_token_ids=allowed + list(llm.llm_engine.eos_token_ids), bad_words=[words[0]])
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        assert out.outputs[0].text in words[1:], out.outputs[0].text


def test_prefix_caching_and_preemption(llm):
    # 24 blocks of 4 tokens for six requests and their outputs: requests are preempted and recomputed, and the
    # second round of prompts reads the first's cached blocks.
    small = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(num_gpu_blocks_override=24, enable_prefix_caching=True))
    allowed = _allowed_ids(llm)
    bad = _bad_word(llm, llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False))
    params = [SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[bad])]
    outs = small.generate(PROMPTS * 2, [p for p in params for _ in range(3)], use_tqdm=False)
    want = llm.generate(PROMPTS * 2, [p for p in params for _ in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    _check(llm, outs[:3], allowed=allowed)
    _check(llm, outs[3:], bad=bad)
    stats = small.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def _mixed_params(llm):
    allowed = _allowed_ids(llm)
    bad = _bad_word(llm, llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False))
    return [SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=allowed),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[bad]),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_tensor_parallel(llm):
    params = _mixed_params(llm)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    tp = LLM(checkpoint("llama_gqa"), tensor_parallel_size=2, **small_engine_kwargs())
    outs = tp.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_data_parallel(llm):
    """Two replica processes: the params travel by pickle, and the router checks the rules before sending."""
    params = _mixed_params(llm)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    dp = LLM(checkpoint("llama_gqa"), data_parallel_size=2, **small_engine_kwargs())
    try:
        outs = dp.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        with pytest.raises(ValueError, match=r"allowed_token_ids=\[\.\.\., 999999, \.\.\.\] is invalid"):
            dp.generate(["x"], SamplingParams(allowed_token_ids=[5, 999999]), use_tqdm=False)
        assert not dp.llm_engine.has_unfinished_requests()
    finally:
        dp.llm_engine.close()


def test_out_of_vocabulary_and_no_tokenizer(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids=\[\.\.\., 999999, \.\.\.\] is invalid: token id 999999"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[5, 999999]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    bare = LLM(checkpoint("llama_gqa"), skip_tokenizer_init=True, **small_engine_kwargs())
    with pytest.raises(ValueError, match="bad_words=.*needs the model's tokenizer"):
        bare.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(bad_words=["x"]), use_tqdm=False)
    outs = bare.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                           allowed_token_ids=[9, 10]), use_tqdm=False)
    assert set(outs[0].outputs[0].token_ids) <= {9, 10}


def test_speculative_decoding(llm):
    """A request with rules does not speculate (its mask at each position would follow the proposals before it):
    it decodes a token per verify step beside requests that do, and every output is the plain engine's."""
    spec = speculative_engine({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    repetitive = "a b c a b c a b c a b c"
    params = _mixed_params(llm)
    prompts = [repetitive, repetitive, repetitive, PROMPTS[0]]
    params = [params[0], params[1], params[2], params[1]]
    outs = generate(spec, prompts, params)
    want = generate(spec, prompts, params, speculate=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    _check(llm, [outs[0]], allowed=_allowed_ids(llm))
    assert spec.llm_engine.speculator.stats.num_drafts > 0

"""The acceptance rule alone (jaxserve.spec_decode.rejection.accept), on fixed logits.

Rejection sampling must emit tokens distributed exactly as the target's sampling distribution p, whatever
the proposals. Chi-square tests over N independent rows (seeds 0..N-1): each check rejects at significance
1e-3, i.e. with genuinely correct sampling it would fail for 0.1% of seed sets; the seeds are fixed, so the
test is deterministic. A wrong rule (accepting proposals always, or never renormalising) fails by far.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from scipy import stats

from jaxserve.sampling_metadata import MAX_BANNED, SamplingMetadata
from jaxserve.spec_decode.rejection import accept

N = 6000
ALPHA = 1e-3
V = 6
LOGITS = np.log(np.array([[0.05, 0.4, 0.1, 0.2, 0.15, 0.1],  # position 0
                          [0.3, 0.1, 0.25, 0.05, 0.2, 0.1],  # position 1
                          [0.1, 0.1, 0.1, 0.5, 0.1, 0.1]], np.float32))  # position 2 (bonus)


def _md(rows: int, temperature: float, top_k: int = 0, k: int = 2, bias=None) -> SamplingMetadata:
    seeds = np.repeat(np.arange(rows // (k + 1), dtype=np.uint32), k + 1)
    steps = np.tile(np.arange(k + 1, dtype=np.int32), rows // (k + 1))
    f = np.float32
    return SamplingMetadata(
        temperature=np.full(rows, temperature, f), top_k=np.full(rows, top_k, np.int32), top_p=np.ones(rows, f),
        min_p=np.zeros(rows, f), presence_penalty=np.zeros(rows, f), frequency_penalty=np.zeros(rows, f),
        repetition_penalty=np.ones(rows, f), seeds=seeds, steps=steps, history=np.full((rows, 0), -1, np.int32),
        prompt_lens=np.zeros(rows, np.int32), banned=np.full((rows, MAX_BANNED), -1, np.int32),
        all_greedy=temperature == 0, needs_filters=top_k > 0, needs_bias=bias is not None,
        bias_ids=None if bias is None else np.tile(np.array([list(bias)], np.int32), (rows, 1)),
        bias_values=None if bias is None else np.tile(np.array([list(bias.values())], np.float32), (rows, 1)),
    )


def _run(draft, temperature=1.0, top_k=0, bias=None):
    k = len(draft)
    logits = jnp.asarray(np.tile(LOGITS[: k + 1], (N, 1)))  # [N*(K+1), V]: N sequences, K+1 rows each
    rows = np.stack([
        np.tile(np.asarray(list(draft) + [-1], np.int32), N),  # the proposal each row scores
        np.repeat(np.arange(N, dtype=np.int32), k + 1),  # its sequence
        np.tile(np.arange(k + 1, dtype=np.int32), N),  # its position
    ])  # fmt: skip
    md = _md(N * (k + 1), temperature, top_k, k, bias)
    tokens, emitted, _ = accept(logits, jnp.asarray(rows), jnp.full(N, k, jnp.int32), md, k)
    return np.asarray(tokens), np.asarray(emitted)


def _p(position, top_k=0, bias=None):
    p = np.exp(LOGITS[position].astype(np.float64))
    for t, b in (bias or {}).items():  # logit_bias multiplies a token's odds by e^b
        p[t] *= np.exp(b)
    if top_k:
        p[np.argsort(-p)[top_k:]] = 0
    return p / p.sum()


def _chi2_ok(samples, p):
    counts = np.bincount(samples, minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0, counts
    _, pvalue = stats.chisquare(counts[support], p[support] * len(samples))
    return pvalue > ALPHA


def test_emitted_tokens_follow_the_target_distribution():
    draft = [1, 0]  # a likely and an unlikely proposal
    tokens, emitted = _run(draft)
    assert _chi2_ok(tokens[:, 0], _p(0))
    # Given the first proposal was accepted, the second token is distributed as position 1's p.
    second = tokens[emitted >= 2, 1]
    assert _chi2_ok(second, _p(1))
    third = tokens[emitted == 3, 2]  # both accepted: the bonus token from position 2
    assert len(third) > 100 and _chi2_ok(third, _p(2))
    # The acceptance rate of the first proposal is p(d) (a point-mass draft is accepted with probability p(d)).
    assert abs((emitted >= 2).mean() - _p(0)[1]) < 4 * np.sqrt(0.24 / N)


def test_with_top_k_the_target_is_the_filtered_distribution():
    tokens, _ = _run([0, 2], top_k=3)  # proposal 0 lies outside position 0's top 3: always rejected
    assert _chi2_ok(tokens[:, 0], _p(0, top_k=3))


def test_with_logit_bias_the_target_is_the_biased_distribution():
    bias = {0: 1.5, 3: -100.0}  # proposal 0 made likelier at position 0; token 3 never emitted
    tokens, emitted = _run([0, 3], bias=bias)
    assert _chi2_ok(tokens[:, 0], _p(0, bias=bias))
    assert (emitted <= 2).all()  # proposal 3 is always rejected: p(3) = 0 under the bias
    assert abs((emitted >= 2).mean() - _p(0, bias=bias)[0]) < 4 * np.sqrt(0.25 / N)


def test_a_wrong_rule_would_fail():
    tokens, _ = _run([1, 0])
    always_accepted = np.full(N, 1)
    assert not _chi2_ok(always_accepted, _p(0))
    assert (tokens[:, 0] != 1).sum() > 0  # rejections happen


def test_greedy_rows_accept_the_matching_prefix():
    argmaxes = LOGITS.argmax(-1)  # [3]
    for draft, want in (([argmaxes[0], argmaxes[1]], 3), ([argmaxes[0], 5], 2), ([5, argmaxes[1]], 1)):
        tokens, emitted = _run(draft, temperature=0.0)
        assert (emitted == want).all()
        assert (tokens[:, :want] == argmaxes[:want]).all()

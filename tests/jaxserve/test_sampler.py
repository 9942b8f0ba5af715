"""The on-device sampler against plain numpy: greedy, seeds, filters, temperature, penalties, logprobs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import sampler as sampler_mod
from jaxserve.sampler import exact_top_k, sample, to_runner_output
from jaxserve.sampling_metadata import SamplingMetadata
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.scheduler_output import ScheduledSeq

V = 64
jit_sample = jax.jit(sample)


def seq(params: SamplingParams, seed: int = 0, step: int = 0, history=(), num_prompt: int = 0, sample=True):
    return ScheduledSeq(
        req_id=f"r{seed}",
        token_ids=[1],
        start_pos=0,
        block_ids=[0],
        sample=sample,
        sampling_params=params,
        seed=seed,
        num_output_tokens=step,
        history=list(history),
        num_prompt_tokens=num_prompt,
    )


def logits_like(rows: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)  # [S, V]


DRAWS = 3000  # one batch size for every many-draw test: one compile per flag combination


def draw_many(logits_row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """DRAWS independent samples from one row: one row per seed, so one call gives them all."""
    seqs = [seq(params, seed=s) for s in range(DRAWS)]
    md = SamplingMetadata.from_seqs(seqs, DRAWS)
    return np.asarray(jit_sample(jnp.asarray(np.tile(logits_row, (DRAWS, 1))), md).token_ids)  # [N]


def softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_greedy_is_argmax_and_padding_rows_are_harmless():
    logits = logits_like(8)
    md = SamplingMetadata.from_seqs([seq(SamplingParams(temperature=0.0)) for _ in range(5)], 8)
    assert md.all_greedy and not md.needs_filters
    out = to_runner_output(jit_sample(jnp.asarray(logits), md), 5)
    assert out.sampled_token_ids == np.argmax(logits[:5], -1).tolist()
    assert out.sampled_logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = logits_like(6, seed=1)
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, SamplingParams(temperature=1.5, top_k=5), greedy]
    md = SamplingMetadata.from_seqs([seq(p, seed=i) for i, p in enumerate(params)], 6)
    assert not md.all_greedy and md.needs_filters
    ids = np.asarray(jit_sample(jnp.asarray(logits), md).token_ids)
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_same_seed_same_tokens_whatever_the_batch_and_row():
    base = logits_like(1, vocab=1000, seed=2, scale=0.5)[0]  # flat: a draw depends on the noise
    params = SamplingParams(temperature=1.0, top_p=0.95)

    def draw(seed, step, row, rows, others):
        logits = logits_like(rows, vocab=1000, seed=others, scale=0.5)
        logits[row] = base
        seqs = [seq(params, seed=100 + others + i, step=i) for i in range(rows)]
        seqs[row] = seq(params, seed=seed, step=step)
        md = SamplingMetadata.from_seqs(seqs, rows)
        return int(jit_sample(jnp.asarray(logits), md).token_ids[row])

    for step in range(3):
        got = {draw(7, step, row, rows, others) for row, rows, others in [(0, 1, 0), (3, 4, 1), (5, 8, 2), (0, 8, 3)]}
        assert len(got) == 1, f"step {step}: the same seed gave {got} in different batches"
    firsts = [draw(s, 0, 0, 1, 0) for s in range(20)]
    assert len(set(firsts)) > 5, "different seeds should give different draws from a flat distribution"
    assert len({draw(7, s, 0, 1, 0) for s in range(20)}) > 5, "the step must change the key"


def test_top_k_never_leaves_the_k_best():
    row = logits_like(1, seed=3, scale=1.0)[0]
    ids = draw_many(row, SamplingParams(temperature=2.0, top_k=4))
    best = set(np.argsort(-row)[:4].tolist())
    assert set(ids.tolist()) == best  # all four reached with a hot temperature, nothing else


def test_top_p_restricts_to_the_nucleus():
    row = logits_like(1, seed=4, scale=2.0)[0]
    ids = draw_many(row, SamplingParams(temperature=1.0, top_p=0.6))
    p = softmax(row)
    order = np.argsort(-p)
    before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])  # mass strictly before each sorted token
    nucleus = set(order[before < 0.6].tolist())
    assert set(ids.tolist()) <= nucleus and len(set(ids.tolist())) == len(nucleus)


def test_top_p_wider_than_the_cap_takes_the_exact_path(monkeypatch):
    monkeypatch.setattr(sampler_mod, "FILTER_CAP", 4)
    row = logits_like(1, seed=5, scale=0.3)[0]  # flat: the 0.9 nucleus has far more than 4 tokens
    probs = jnp.asarray(softmax(row)[None].astype(np.float32))
    got = float(sampler_mod._top_k_top_p_threshold(probs, jnp.array([0]), jnp.array([0.9]))[0])
    p = np.sort(np.asarray(probs[0]))[::-1]
    want = p[np.sum(np.cumsum(p) < 0.9 * p.sum())]
    assert got == pytest.approx(want, rel=1e-6)
    # top_k beyond the cap too
    got_k = float(sampler_mod._top_k_top_p_threshold(probs, jnp.array([10]), jnp.array([1.0]))[0])
    assert got_k == p[9]
    # The whole sampler takes that path too (a fresh jit: traced with the small cap).
    ids = np.asarray(jax.jit(sample)(jnp.tile(jnp.asarray(row), (256, 1)), SamplingMetadata.from_seqs(
        [seq(SamplingParams(top_p=0.9), seed=s) for s in range(256)], 256)).token_ids)
    assert set(ids.tolist()) <= set(np.flatnonzero(np.asarray(probs[0]) >= want).tolist())
    assert len(set(ids.tolist())) > 4


def test_top_k_then_top_p_renormalises_over_the_k_best():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.05, 0.05] + [1e-9] * 3, np.float32))
    # top_k=3 leaves (0.4, 0.3, 0.2) / 0.9; top_p=0.7 of that needs 0.63: the first two (0.4 < 0.63 <= 0.7).
    ids = draw_many(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert set(ids.tolist()) == {0, 1}


def test_min_p_keeps_tokens_above_a_share_of_the_best():
    row = np.log(np.array([0.5, 0.3, 0.12, 0.05, 0.03], np.float32))
    ids = draw_many(row, SamplingParams(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert set(ids.tolist()) == {0, 1, 2}


def test_temperature_scales_the_distribution():
    row = np.array([1.0, 0.5, 0.0, -0.5, -1.0, -2.0], np.float32)
    for temperature in (0.5, 1.0, 2.0):
        ids = draw_many(row, SamplingParams(temperature=temperature))
        freq = np.bincount(ids, minlength=len(row)) / DRAWS
        want = softmax(row / temperature)
        # chi-square statistic against the expected counts; 5 dof, p=0.001 critical value is 20.5
        chi2 = float(np.sum((freq - want) ** 2 / want) * DRAWS)
        assert chi2 < 20.5, f"temperature {temperature}: frequencies {freq} vs {want} (chi2 {chi2:.1f})"


def penalised_reference(logits: np.ndarray, history: list[int], num_prompt: int, sp: SamplingParams) -> np.ndarray:
    """HF/vLLM semantics, one row at a time, in float64."""
    out = logits.astype(np.float64).copy()
    for t in set(history):  # repetition: prompt and generated tokens
        out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    generated = history[num_prompt:]
    for t in set(generated):
        out[t] -= sp.frequency_penalty * generated.count(t) + sp.presence_penalty
    return out


def test_penalties_match_a_numpy_reference():
    rng = np.random.default_rng(6)
    logits = logits_like(4, seed=6)
    cases = [
        (SamplingParams(temperature=0.0, repetition_penalty=1.7), 5),
        (SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=-0.4), 3),
        (SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-1.2, presence_penalty=1.5), 0),
        (SamplingParams(temperature=0.0), 2),  # no penalty: untouched even next to rows that have one
    ]
    seqs, histories = [], []
    for i, (sp, num_prompt) in enumerate(cases):
        history = rng.integers(0, 12, size=10).tolist()  # small id range: plenty of repeats
        histories.append(history)
        seqs.append(seq(sp, seed=i, history=history, num_prompt=num_prompt))
    md = SamplingMetadata.from_seqs(seqs, 4, history_len=16)
    assert md.needs_penalties and md.history.shape == (4, 16)
    got = np.asarray(jax.jit(sampler_mod.apply_penalties)(jnp.asarray(logits), md))
    for i, (sp, num_prompt) in enumerate(cases):
        want = penalised_reference(logits[i], histories[i], num_prompt, sp)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    # Greedy rows take the argmax of the penalised logits.
    ids = np.asarray(jit_sample(jnp.asarray(logits), md).token_ids)
    assert ids.tolist() == got.argmax(-1).tolist()


def test_history_len_too_short_is_an_error():
    s = seq(SamplingParams(repetition_penalty=1.2), history=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="history_len=2"):
        SamplingMetadata.from_seqs([s], 2, history_len=2)


def test_logprobs_and_ranks_match_log_softmax():
    logits = logits_like(5, vocab=300, seed=7)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, logprobs=20),
              SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.3, logprobs=0)]
    seqs = [seq(p, seed=i, history=[5, 6], num_prompt=1) for i, p in enumerate(params)]
    md = SamplingMetadata.from_seqs(seqs, 5, history_len=4)
    assert md.needs_logprobs and md.needs_penalties
    out = to_runner_output(jit_sample(jnp.asarray(logits), md), 3)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))  # [S, V]
    for r in range(3):
        token = out.sampled_token_ids[r]
        assert out.sampled_logprobs[r] == pytest.approx(ref[r, token], abs=1e-5)
        assert out.sampled_ranks[r] == 1 + int(np.sum(ref[r] > ref[r, token]))
        order = np.argsort(-ref[r], kind="stable")[:MAX_LOGPROBS]
        assert out.top_token_ids[r] == order.tolist()
        np.testing.assert_allclose(out.top_logprobs[r], ref[r, order], atol=1e-5)
    assert out.sampled_ranks[0] == 1  # greedy without penalty: the most likely token


def test_exact_top_k_matches_lax_top_k():
    rng = np.random.default_rng(8)
    for vocab, k in [(5000, 20), (4099, 256), (300, 20), (10, 10)]:
        x = jnp.asarray(rng.standard_normal((3, vocab)).astype(np.float32))
        values, indices = exact_top_k(x, k)
        want_values, want_indices = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(indices, want_indices)


def test_rows_that_sample_nothing_and_flags():
    chunk = seq(SamplingParams(temperature=1.0, top_p=0.5, logprobs=2, presence_penalty=1.0), sample=False)
    md = SamplingMetadata.from_seqs([chunk], 4)
    assert md.all_greedy and not (md.needs_filters or md.needs_logprobs or md.needs_penalties)
    variants = list(SamplingMetadata.warmup_variants(4))
    assert len({(v.all_greedy, v.needs_filters, v.needs_logprobs) for v in variants}) == len(variants) == 6
    logits = jnp.asarray(logits_like(4))
    for v in variants:  # traced, not compiled: shapes and which outputs exist
        out = jax.eval_shape(sample, logits, v)
        assert out.token_ids.shape == (4,) and ((out.top_logprobs is not None) == v.needs_logprobs)


def test_minus_inf_logits_are_never_sampled():
    # A vocabulary padded with -inf logits (unused ids) must never be sampled, filters or not.
    logits = logits_like(2, seed=9)
    logits[:, 40:] = -np.inf
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01)):
        ids = draw_many(logits[0], params)
        assert ids.max() < 40
    out = to_runner_output(jit_sample(jnp.asarray(logits), SamplingMetadata.from_seqs(
        [seq(SamplingParams(logprobs=5))], 2)), 1)
    assert all(np.isfinite(out.top_logprobs[0][:5])) and max(out.top_token_ids[0][:5]) < 40


def test_seeds_beyond_32_bits_are_accepted():
    md = SamplingMetadata.from_seqs([seq(SamplingParams(temperature=1.0), seed=2**40 + 3)], 1)
    assert md.seeds.dtype == np.uint32 and int(md.seeds[0]) == 3


@pytest.mark.parametrize("vocab", [64, 200, 1000])
def test_blocked_argmax_matches_jnp_argmax(vocab):
    """First index of the maximum, whatever the vocabulary size (padded blocks), ties and -inf rows."""
    x = logits_like(6, vocab=vocab, seed=11)
    x[1, [3, vocab - 1]] = x[1].max() + 1  # a tie across blocks: the first wins
    x[2, [vocab - 2, vocab - 1]] = x[2].max() + 1  # a tie inside the last (padded) block
    x[3] = -np.inf  # all banned: index 0, as jnp.argmax
    x[4] = 0.0  # all equal
    np.testing.assert_array_equal(np.asarray(sampler_mod.argmax(jnp.asarray(x))), np.argmax(x, -1))


def test_greedy_fast_path_skips_bans_only_when_no_row_bans():
    """No row bans: the bare argmax gives the same tokens as the full path; a banned best token is not sampled."""
    logits = logits_like(4, seed=12)
    greedy = SamplingParams(temperature=0.0)
    md = SamplingMetadata.from_seqs([seq(greedy) for _ in range(3)], 4)
    assert md.all_greedy and not (md.needs_bans or md.needs_penalties or md.needs_logprobs)
    fast = np.asarray(jit_sample(jnp.asarray(logits), md).token_ids)
    full = np.asarray(jit_sample(jnp.asarray(logits), dataclasses.replace(md, needs_bans=True)).token_ids)
    np.testing.assert_array_equal(fast, full)
    np.testing.assert_array_equal(fast, np.argmax(logits, -1))
    best = int(logits[0].argmax())
    held = seq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[best]))
    md = SamplingMetadata.from_seqs([held], 4)
    assert md.needs_bans
    ids = np.asarray(jit_sample(jnp.asarray(logits), md).token_ids)
    assert ids[0] != best and ids[0] == np.argsort(logits[0])[-2]

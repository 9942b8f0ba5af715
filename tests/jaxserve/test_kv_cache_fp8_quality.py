"""What an fp8 KV cache costs on the real default model (SmolLM2-135M-Instruct): 32 fixed prompts, greedy,
fp8_e4m3 and fp8_e5m2 caches against the model-dtype cache (float32 on CPU).

Two measures: the share of identical greedy completions, and the mean KL divergence KL(auto || fp8) of the
next-token distributions at every position where both runs still share their context (up to and including
the first differing token). The engine returns each position's top 21 log-probabilities (the sampled token
and 20 alternatives), so the KL is summed over auto's top 21 tokens; a token missing from fp8's top 21 gets
fp8's 21st log-probability (an upper bound on its probability, so the KL is if anything underestimated; the
top 21 tokens hold nearly all of the mass of a trained model's distribution).
"""

from __future__ import annotations

import math

import pytest

from engine_fixtures import run_cache_dir

from jaxserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in our solar system is",
    "To make a cup of tea, first", "The opposite of hot is", "Photosynthesis is the process by which",
    "The first president of the United States was", "A triangle has", "The chemical symbol for gold is",
    "In the morning I like to", "The speed of light is approximately", "Shakespeare wrote the play",
    "The main ingredient of guacamole is", "One plus one equals", "The Great Wall of China was built to",
    "My favourite colour is", "The tallest mountain in the world is", "Dogs are often called man's best",
    "The square root of sixty-four is", "Python is a programming language that", "The sun rises in the",
    "A healthy breakfast includes", "The longest river in Africa is", "Computers store data in",
    "The Eiffel Tower is located in", "Bees make honey from", "The freezing point of water is",
    "An apple a day keeps", "The author of Harry Potter is", "Rain is caused by",
    "The currency of Japan is the", "Once upon a time, there was a",
]  # fmt: skip
MAX_TOKENS = 16


def _run(kv_cache_dtype: str):
    llm = LLM(
        kv_cache_dtype=kv_cache_dtype, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=32,
        precompile="none", compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False,
    )  # fmt: skip
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=20), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _kl(p: dict, q: dict) -> float:
    floor = min(lp.logprob for lp in q.values())
    return sum(math.exp(lp.logprob) * (lp.logprob - q[t].logprob if t in q else lp.logprob - floor)
               for t, lp in p.items())  # fmt: skip


def _compare(base, other) -> tuple[float, float]:
    """(share of identical completions, mean KL over positions with a shared context)."""
    same, kls = 0, []
    for (ids_a, lps_a), (ids_b, lps_b) in zip(base, other):
        same += ids_a == ids_b
        for i in range(min(len(ids_a), len(ids_b))):
            kls.append(_kl(lps_a[i], lps_b[i]))
            if ids_a[i] != ids_b[i]:
                break
    return same / len(base), sum(kls) / len(kls)


@pytest.mark.slow
def test_fp8_kv_cache_quality_on_default_model():
    base = _run("auto")
    e4m3 = _compare(base, _run("fp8_e4m3"))
    e5m2 = _compare(base, _run("fp8_e5m2"))
    print(f"\nidentical completions / mean KL vs auto: e4m3 {e4m3[0]:.0%} {e4m3[1]:.2e}; e5m2 {e5m2[0]:.0%} {e5m2[1]:.2e}")
    # Measured on CPU (float32 model, 2026-12-01): e4m3 38% identical, mean KL 7.3e-3; e5m2 16%, 2.7e-2. e5m2's
    # rounding step is twice e4m3's, and its KL about 4x (KL grows as the square of a small perturbation).
    # The bounds leave ~2.5x on the KL and ~1/3 on the share for other XLA versions and machines; a broken
    # scale or clamp gives KLs of order 1 and almost no identical completions.
    assert e4m3[1] < e5m2[1] and e4m3[0] >= e5m2[0]  # 3 mantissa bits beat 2
    assert e4m3[1] < 2e-2 and e4m3[0] >= 0.25
    assert e5m2[1] < 7e-2 and e5m2[0] >= 0.05

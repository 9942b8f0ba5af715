"""An fp8 KV cache under the engine's features: prefix caching, preemption, chunked prefill and data
parallelism each give exactly the tokens of the same fp8 engine without that feature (each feature only
changes which step computes a token's K/V, or whether it is recomputed or shared; the fp8 values stored for
it are the same)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams

MAX_TOKENS = 16
# Without any feature: no prefix caching, every prompt whole in one step, blocks for everyone.
PLAIN = dict(enable_prefix_caching=False, max_num_batched_tokens=64, num_gpu_blocks_override=200)
# Each engine costs seconds of compiling on 2 CPU cores, so the three single-process features share one engine
# (its stats show each of them happened) and DP has its own.
FEATURES = {
    # prefix caching on; prompts of 30-45 tokens in 2-3 chunks; 24 blocks for sequences of up to 16 blocks each,
    # so two run at once and are preempted as they grow
    "prefix_chunked_preempted": dict(enable_prefix_caching=True, max_num_batched_tokens=16, num_gpu_blocks_override=24),
    "dp2": dict(PLAIN, data_parallel_size=2),
}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    prefix = rng.integers(2, 500, size=24).tolist()  # shared: the later prompts hit the first one's blocks
    return [prefix + rng.integers(2, 500, size=n).tolist() for n in (6, 17, 2, 21)] + [
        rng.integers(2, 500, size=n).tolist() for n in (30, 41)
    ]


@functools.lru_cache(maxsize=None)
def _run(feature: str) -> tuple:
    kw = PLAIN if feature == "plain" else FEATURES[feature]
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(max_model_len=64, kv_cache_dtype="fp8",
                                                             precompile="none", **kw))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats() if feature != "dp2" else None
    tokens = tuple(tuple(o.outputs[0].token_ids) for o in outs)
    llm.llm_engine.close() if hasattr(llm.llm_engine, "close") else None
    return tokens, stats


@pytest.mark.parametrize("feature", list(FEATURES))
def test_fp8_feature_gives_the_plain_fp8_tokens(feature):
    if feature == "dp2" and len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    tokens, stats = _run(feature)
    plain, plain_stats = _run("plain")
    assert plain_stats.prefix_cache_hits == 0 and plain_stats.num_preemptions == 0
    if feature == "prefix_chunked_preempted":
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    assert tokens == plain

"""kv_cache_dtype=fp8*: validated, sized in fp8 bytes, and served end to end (prefix caching, preemption)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineArgs


def _generate(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8-e5m2"])
def test_names_accepted(name):
    EngineArgs(kv_cache_dtype=name).validate()


def test_bad_name_refused_and_every_backend_takes_fp8():
    from jaxserve.pallas_kernels.attention import check_kv_cache_dtype

    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp16'.*fp8_e4m3"):
        EngineArgs(kv_cache_dtype="fp16").validate()
    for platform in ("cpu", "gpu", "tpu"):  # the TPU op's adapter reads fp8 too (test_tpu_ragged_adapter.py)
        for backend in ("reference", "xla", "pallas"):
            check_kv_cache_dtype("fp8_e5m2", backend, platform)


def test_budget_counts_fp8_bytes():
    """The same memory holds 4x the float32 blocks (2x the bfloat16 ones) in fp8."""
    import jax.numpy as jnp

    from jaxserve.config import CacheConfig
    from jaxserve.kv_cache import bytes_per_block, num_blocks_for
    from jaxserve.pallas_kernels.fp8 import kv_cache_dtype_for

    def blocks(name, model_dtype):
        cache = CacheConfig(16, 0.9, None, 4.0, name, True)  # 4 GiB
        per_block = bytes_per_block(32, 8, 128, 16, kv_cache_dtype_for(name, model_dtype))
        return num_blocks_for(cache, platform="cpu", block_bytes=per_block, max_model_len=4096, max_num_seqs=1024,
                              activation_reserve_bytes=0)  # fmt: skip

    assert blocks("fp8", jnp.float32) == 4 * blocks("auto", jnp.float32)
    assert blocks("fp8_e5m2", jnp.bfloat16) == 2 * blocks("auto", jnp.bfloat16)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow  # ~22 s on 2 CPU cores
def test_fp8_engine_prefix_caching_and_preemption():
    """Over fp8 blocks, a batch with prefix hits and preemptions gives exactly the tokens of each prompt run
    alone (recomputed or shared blocks hold the same fp8 values), and mostly the float32 cache's tokens."""
    path = checkpoint("llama_gqa")
    rng = np.random.default_rng(5)
    prefix = rng.integers(2, 500, size=24).tolist()
    prompts = [prefix + rng.integers(2, 500, size=n).tolist() for n in (6, 17, 2, 21)]
    prompts += [rng.integers(2, 500, size=n).tolist() for n in (30, 41)]
    got = {}
    for name in ("fp8", "auto"):
        llm = LLM(path, **small_engine_kwargs(kv_cache_dtype=name, num_gpu_blocks_override=40))
        got[name] = _generate(llm, prompts[:1], 12) + _generate(llm, prompts[1:], 12)  # the first fills the prefix
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, name
        if name == "fp8":
            assert llm.llm_engine.runner.kv_caches[0][0].dtype.name == "float8_e4m3fn"
            assert got[name] == [_generate(llm, [p], 12)[0] for p in prompts]
    agree = [_common_prefix(a, b) for a, b in zip(got["fp8"], got["auto"])]
    print("fp8 vs float32 cache, tokens agreeing before the first difference (of 12):", agree)
    assert sum(agree) >= 0.5 * 12 * len(prompts), agree


@pytest.mark.slow  # ~22 s: two engines
@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs 2 devices (conftest fakes 8 CPU devices)")
def test_fp8_cache_under_tensor_parallelism():
    """TP=2 shards the fp8 pages by KV heads and gives TP=1's fp8 tokens."""
    path = checkpoint("llama_gqa")
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (3, 17, 40)]
    got = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, **small_engine_kwargs(max_model_len=64, kv_cache_dtype="fp8"))
        k_pages = llm.llm_engine.runner.kv_caches[0][0]
        assert k_pages.dtype.name == "float8_e4m3fn"
        heads_axis = 1 if llm.llm_engine.runner.kv_heads_major else 2  # [N, K, P, D] (the xla backend) or [N, P, K, D]
        assert k_pages.addressable_shards[0].data.shape[heads_axis] == 2 // tp  # split over the 2 KV heads
        got[tp] = _generate(llm, prompts, 8)
    assert got[2] == got[1]

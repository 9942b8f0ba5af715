"""calculate_kv_scales: fp8 K/V scales from the first prefill's amax, on a model whose keys and values lie far
beyond e4m3's +-448 (scale 1.0 clips them), and nothing changes when it is off."""

from __future__ import annotations

import functools
import math
import os
import shutil

import numpy as np
import pytest
from engine_fixtures import _ROOT, checkpoint, small_engine_kwargs
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineArgs

BIG = 2000.0  # |K|, |V| of the tiny model are ~1: times BIG they exceed 448


@functools.lru_cache(maxsize=None)
def _loud_model() -> str:
    """llama_gqa with K and V BIG times larger and q, o_proj BIG times smaller: the same function (up to float
    rounding), but keys and values of order 1e3."""
    path = os.path.join(_ROOT, "llama_loud_kv")
    if not os.path.exists(path):
        shutil.copytree(checkpoint("llama_gqa"), path)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        for name in list(tensors):
            factor = {"k_proj": BIG, "v_proj": BIG, "q_proj": 1 / BIG, "o_proj": 1 / BIG}.get(name.split(".")[-2])
            if factor is not None:
                tensors[name] = (tensors[name] * factor).astype(np.float32)
        save_file(tensors, file, metadata={"format": "pt"})
    return path


@functools.lru_cache(maxsize=None)
def _run(**kw) -> tuple[list[dict[int, float]], LLM]:
    """Each generated position's top-20 logprobs, and the LLM."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (5, 19, 40)]  # 40 > the 32-token budget: chunked
    llm = LLM(_loud_model(), **small_engine_kwargs(max_model_len=64, precompile="none", **kw))
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [{t: lp.logprob for t, lp in pos.items()} for o in outs for pos in o.outputs[0].logprobs]
    assert all(math.isfinite(v) for d in got for v in d.values()), "inf/NaN logprobs"
    return got, llm


def _distance(base: list[dict], other: list[dict]) -> float:
    """Largest |logprob difference| over base's top-20 tokens (missing ones count at other's lowest)."""
    worst = 0.0
    for a, b in zip(base, other):
        floor = min(b.values())
        worst = max(worst, max(abs(v - b.get(t, floor)) for t, v in a.items()))
    return worst


def test_calculated_scales_beat_scale_one_on_large_kv():
    base, _ = _run()  # float32 cache
    plain, plain_llm = _run(kv_cache_dtype="fp8")  # scale 1.0: K/V clipped to +-448
    # Off: no traced scales, no calibration: the steps are the static-scale programs.
    assert plain_llm.llm_engine.runner._kv_scales_arr is None and not plain_llm.llm_engine.runner.calculate_kv_scales
    calc, llm = _run(kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = llm.llm_engine.runner.kv_scales
    # amax / 448 with |K|, |V| of order BIG: scales well above 1, per layer, K and V apart.
    assert len(scales) == 2 and all(k > 1 and v > 1 for k, v in scales), scales
    d_plain, d_calc = _distance(base, plain), _distance(base, calc)
    print(f"max |logprob - float32 cache's|: scale 1.0 {d_plain:.3g}, calculated {d_calc:.3g}")
    assert d_calc < 0.25 * d_plain and d_calc < 0.2, (d_plain, d_calc)


def test_off_by_default_and_validated():
    assert EngineArgs().calculate_kv_scales is False
    with pytest.raises(ValueError, match=r"calculate_kv_scales=True.*kv_cache_dtype='fp8'"):
        EngineArgs(calculate_kv_scales=True).validate()
    from jaxserve.cli import add_engine_args, engine_args_from

    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert engine_args_from(ns).calculate_kv_scales is True


def test_scales_from_amax():
    import jax.numpy as jnp

    from jaxserve.kv_scale_calibration import scales_from_amax

    amax = np.array([[448.0, 896.0], [0.0, 1.0]], np.float32)
    assert scales_from_amax(amax, jnp.float8_e4m3fn) == [(1.0, 2.0), (1.0, 1 / 448)]  # all-zero layer: 1.0
    assert scales_from_amax(amax, jnp.float8_e5m2)[0] == (448 / 57344, 896 / 57344)


@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs 2 devices (conftest fakes 8 CPU devices)")
def test_calculated_scales_under_tensor_parallelism():
    """TP=2 calibrates on the sharded model to the same scales and serves the same tokens as TP=1."""
    one, llm1 = _run(kv_cache_dtype="fp8", calculate_kv_scales=True)
    two, llm2 = _run(kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=2)
    np.testing.assert_allclose(llm2.llm_engine.runner.kv_scales, llm1.llm_engine.runner.kv_scales, rtol=1e-5)
    assert [max(d, key=d.get) for d in two] == [max(d, key=d.get) for d in one]


def test_calibration_attention_equals_packed_attention(monkeypatch):
    """The calibration's blocked attention (here in blocks of 16 over 40 tokens: 3 blocks, the last padded) gives
    packed_causal_attention's output, and its amax skips padding tokens."""
    import jax
    import jax.numpy as jnp

    from jaxserve import kv_scale_calibration
    from jaxserve.models.packed_attention import packed_causal_attention
    from jaxserve.pallas_kernels.metadata import AttentionMetadata

    monkeypatch.setattr(kv_scale_calibration, "QUERY_BLOCK", 16)
    t, real, h, kh, dh = 40, 33, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (t, n, dh)) for i, n in ((0, h), (1, kh), (2, kh)))
    k = k.at[real:].set(1e4)  # padding tokens' keys: must not count
    lens = [9, 20, 4]  # three sequences, then 7 padding tokens
    seq = np.concatenate([np.full(n, i) for i, n in enumerate(lens)] + [np.full(t - real, 2)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens] + [np.zeros(t - real, int)]).astype(np.int32)
    qsl = np.array([0, 9, 29, 33, 33], np.int32)
    z = jnp.zeros(4, jnp.int32)
    md = AttentionMetadata(positions=pos, slot_mapping=np.zeros(t, np.int32), token_seq_ids=seq, query_start_loc=qsl,
                           seq_lens=z, block_tables=jnp.zeros((4, 1), jnp.int32), logits_indices=z)  # fmt: skip
    calib = jax.jit(lambda q, k, v, md: kv_scale_calibration._amax_attention(q, k, v, None, None, md, scale=dh**-0.5))
    out, amax_k, amax_v = calib(q, k, v, md)  # jitted: one compile, not one per op
    md_ref = AttentionMetadata(**{**md.__dict__, "token_seq_ids": np.where(np.arange(t) < real, seq, -1)})
    want, _, _ = jax.jit(lambda q, k, v, md: packed_causal_attention(q, k, v, None, None, md, scale=dh**-0.5))(
        q, k, v, md_ref
    )
    np.testing.assert_allclose(out[:real], want[:real], rtol=1e-5, atol=1e-5)
    assert float(amax_k) == float(jnp.abs(k[:real]).max()) and float(amax_v) == float(jnp.abs(v[:real]).max())

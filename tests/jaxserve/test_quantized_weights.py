"""GGUF weights kept quantized (quantization="gguf", models/quantized.py): the block decoding is exact, the native
kernels compute the dequantized product, and an engine on codes generates what the same file dequantized at load
generates, on every path (chunked prefill, prefix caching, preemption, n > 1, speculation, LoRA, TP, DP), and the
default model on codes generates its dequantized tokens."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, generate, run_cache_dir, small_engine_kwargs
from tiny_gguf import write_gguf_from_hf

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineArgs
from jaxserve.models import quantized
from jaxserve.pallas_kernels import cpu_native

T = gguf.GGMLQuantizationType
PROMPTS = ["The capital of France is", "My phone number is", "x" * 60]  # the last spans chunks (budget 32)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1])
def test_blocks_decode_to_llama_cpps_values(qtype):
    w = np.random.default_rng(0).normal(size=(6, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    codes, scale, offset = quantized.decode_blocks(raw.reshape(-1), qtype.name, w.shape)
    assert codes.dtype == np.int8 and scale.shape == offset.shape == (6, 3)
    want = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    got = np.asarray(quantized.dequantize(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset), axis=1))
    np.testing.assert_array_equal(got, want)  # the same float32 values, bit for bit
    kernel = np.asarray(quantized.dequantize(jnp.asarray(codes.T), jnp.asarray(scale.T), jnp.asarray(offset.T), 0))
    np.testing.assert_array_equal(kernel, want.T)  # a kernel [in, out]: blocks along axis 0


needs_kernels = pytest.mark.skipif(not cpu_native.loaded("qgemm"), reason="no C++ compiler to build the kernels")


@needs_kernels
@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (1, 576, 960), (2, 96, 100), (5, 128, 3), (64, 1536, 576)])
def test_native_products_equal_the_dequantized_ones(m, k, n):
    rng = np.random.default_rng(m * k + n)
    codes = rng.integers(-8, 16, (k, n), dtype=np.int8)
    scale = rng.normal(size=(k // 32, n)).astype(np.float32)
    offset = rng.normal(size=(k // 32, n)).astype(np.float32)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = codes.astype(np.float64).reshape(k // 32, 32, n) * scale[:, None] + offset[:, None]
    want = x.astype(np.float64) @ w.reshape(k, n)
    got = np.asarray(jax.jit(cpu_native.qgemm)(x, codes, scale, offset))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    head = np.asarray(jax.jit(cpu_native.qgemm_t)(x, codes.T.copy(), scale.T.copy(), offset.T.copy()))
    np.testing.assert_allclose(head, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return str(write_gguf_from_hf(checkpoint("llama_gqa"), tmp_path_factory.mktemp("q") / "tiny.gguf", quantized=True))


@pytest.fixture(scope="module")
def dequantized(gguf_file):
    return LLM(gguf_file, quantization="none", **small_engine_kwargs())


@pytest.fixture(scope="module")
def codes(gguf_file):
    return LLM(gguf_file, quantization="gguf", **small_engine_kwargs())


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_codes_in_memory_and_the_same_tokens(dequantized, codes):
    params = codes.llm_engine.runner.params
    assert {str(p.dtype) for p in params} == {"int8", "float32"}
    assert sum(p.nbytes for p in params) < 0.45 * sum(p.nbytes for p in dequantized.llm_engine.runner.params)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    want, got = dequantized.generate(PROMPTS, greedy, use_tqdm=False), codes.generate(PROMPTS, greedy, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    for a, b in zip(got, want):  # the sampled tokens' logprobs agree to float32 rounding
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        np.testing.assert_allclose(la, lb, atol=1e-4)
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=16, ignore_eos=True)
    assert _tokens(codes.generate(PROMPTS, sampled, use_tqdm=False)) == _tokens(
        dequantized.generate(PROMPTS, sampled, use_tqdm=False))


@needs_kernels
def test_native_kernels_run_in_decode_steps_and_a_tied_head(gguf_file, tmp_path, monkeypatch):
    """One-device decode steps take the kernels: qgemm for the projections (and an untied head), qgemm_t for a tied
    head (the quantized embedding table, read in place). A tied model on codes generates its dequantized tokens."""
    calls = []
    for name, tag in (("qgemm", "projections"), ("qgemm_t", "tied head")):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _real=real, _tag=tag: calls.append(_tag) or _real(*a))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    LLM(gguf_file, quantization="gguf", **small_engine_kwargs()).generate(PROMPTS[:1], greedy, use_tqdm=False)
    assert "projections" in calls and "tied head" not in calls
    tied = str(write_gguf_from_hf(checkpoint("llama_mha_tied"), tmp_path / "tied.gguf", quantized=True))
    want = LLM(tied, quantization="none", **small_engine_kwargs()).generate(PROMPTS, greedy, use_tqdm=False)
    got = LLM(tied, quantization="gguf", **small_engine_kwargs()).generate(PROMPTS, greedy, use_tqdm=False)
    assert "tied head" in calls and _tokens(got) == _tokens(want)


def test_prefix_caching_and_preemption(dequantized, gguf_file):
    small = LLM(gguf_file, quantization="gguf",
                **small_engine_kwargs(num_gpu_blocks_override=24, enable_prefix_caching=True))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert _tokens(small.generate(PROMPTS * 2, greedy, use_tqdm=False)) == _tokens(
        dequantized.generate(PROMPTS * 2, greedy, use_tqdm=False))
    stats = small.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_speculative_decoding(dequantized, gguf_file):
    llm = LLM(gguf_file, quantization="gguf", **small_engine_kwargs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    prompts = ["a b c a b c a b c a b c", PROMPTS[0]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _tokens(generate(llm, prompts, greedy)) == _tokens(dequantized.generate(prompts, greedy, use_tqdm=False))
    assert llm.llm_engine.speculator.stats.num_drafts > 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_tensor_parallel(dequantized, gguf_file):
    """TP splits the codes, scales and offsets alike; its programs dequantize inside the step (the native kernels
    run on one device only)."""
    tp = LLM(gguf_file, quantization="gguf", tensor_parallel_size=2, **small_engine_kwargs())
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _tokens(tp.generate(PROMPTS, greedy, use_tqdm=False)) == _tokens(
        dequantized.generate(PROMPTS, greedy, use_tqdm=False))


def test_data_parallel(dequantized, gguf_file):
    dp = LLM(gguf_file, quantization="gguf", data_parallel_size=2, **small_engine_kwargs())
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        assert _tokens(dp.generate(PROMPTS, greedy, use_tqdm=False)) == _tokens(
            dequantized.generate(PROMPTS, greedy, use_tqdm=False))
    finally:
        dp.llm_engine.close()


def test_the_default_and_bad_choices(gguf_file, tmp_path):
    """Unset, the weights are dequantized at load (codes make prompts and batches slower on the CPU: BENCHMARKS
    §44); "gguf" refuses a file with other types, and any format but GGUF."""
    assert not any(str(p.dtype) == "int8" for p in LLM(gguf_file, **small_engine_kwargs()).llm_engine.runner.params)
    plain = str(write_gguf_from_hf(checkpoint("llama_gqa"), tmp_path / "f32.gguf"))
    with pytest.raises(ValueError, match=r"quantization='gguf': this file's weights include \['F32'\]"):
        LLM(plain, quantization="gguf", **small_engine_kwargs())
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's weights quantized, but"):
        LLM(checkpoint("llama_gqa"), quantization="gguf", **small_engine_kwargs())
    with pytest.raises(ValueError, match="quantization='awq' is invalid: choose one of"):
        EngineArgs(quantization="awq").validate()


def test_the_default_model_on_codes():
    """The embedded default model (Q4_1 projections, a Q8_0 embedding) on codes: a third of the bytes, and the
    greedy tokens of the file dequantized at load."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kw = dict(max_model_len=256, compilation_cache_dir=run_cache_dir(), precompile="none", use_tqdm_on_load=False)
    codes = LLM(quantization="gguf", **kw)
    want = LLM(**kw).generate(prompts, greedy, use_tqdm=False)
    assert _tokens(codes.generate(prompts, greedy, use_tqdm=False)) == _tokens(want)
    assert sum(p.nbytes for p in codes.llm_engine.runner.params) < 0.35 * 538e6


def test_lora_on_a_quantized_base(dequantized, gguf_file, tmp_path):
    """An adapter's delta adds onto the codes' product (a quantized base is never folded with the adapters' A)."""
    from lora_fixtures import make_peft_adapter

    from jaxserve.lora.request import LoRARequest

    adapter = make_peft_adapter(checkpoint("llama_gqa"), tmp_path / "a8", r=8)
    lora = LoRARequest("a8", 1, adapter)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for q in ("none", "gguf"):
        llm = LLM(gguf_file, quantization=q, enable_lora=True, max_lora_rank=8, **small_engine_kwargs())
        outs[q] = _tokens(llm.generate(PROMPTS, greedy, lora_request=lora, use_tqdm=False))
    assert outs["gguf"] == outs["none"]
    assert outs["gguf"] != _tokens(dequantized.generate(PROMPTS, greedy, use_tqdm=False))  # the adapter mattered


def test_the_server_on_codes(dequantized, gguf_file):
    """`jaxserve serve FILE.gguf --quantization gguf`: the engine from its arguments, through the openai client."""
    import openai

    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.server.testing import ServerThread

    args = EngineArgs(model=gguf_file, served_model_name="tiny", quantization="gguf", dtype="float32",
                      max_model_len=128, compilation_cache_dir=run_cache_dir(), precompile="none")
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        resp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    want = dequantized.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    assert resp.choices[0].text == want

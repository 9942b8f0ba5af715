"""fp8 weights (quantization="fp8", models/fp8_weights.py) and the GPU's fp8 GEMV kernel (pallas_kernels/fp8_gemv.py,
run here in Pallas's interpreter): the kernel computes the dequantized product (what XLA's product of the codes
computes), an engine runs on fp8 weights under TP and with LoRA, and an fp8 draft keeps speculation exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint, completions, generate, small_engine_kwargs, speculative_engine

from jaxserve import LLM, SamplingParams
from jaxserve.models import fp8_weights
from jaxserve.models.layers import Embed, Linear
from jaxserve.pallas_kernels import fp8_gemv

SPLIT = fp8_gemv.GemvConfig(block_n=128, block_k=128, splits=2)


def _weight(shape, seed=1):
    w = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * 0.02
    axis = len(shape) - 1  # one scale per output over its inputs: the last axis of an output-major [N, K]
    s = jnp.max(jnp.abs(w), axis=axis) / fp8_weights.FP8_MAX
    q = (w / jnp.expand_dims(s, axis)).astype(fp8_weights.FP8)
    return q, s


def _check_kernel(rows, config, dtype, layouts):
    q, s = _weight((384, 512))  # [N, K]
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, 512), jnp.float32).astype(dtype)
    want = np.asarray(x.astype(jnp.float32) @ (q.astype(jnp.float32) * s[:, None]).T)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for layout in layouts:
        if layout == "output-major":
            got = fp8_gemv.fp8_gemv_nk(x, q, s, dtype, config=config, interpret=True)
        else:  # input-major [K, N]; "transposed" reads [N, K] as a tied table is stored
            w, transposed = (q, True) if layout == "transposed" else (q.T, False)
            got = fp8_gemv.fp8_gemv(x, w, s, dtype, transposed=transposed, config=config, interpret=True)
        assert got.shape == (rows, 384) and got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol, err_msg=layout)


@pytest.mark.parametrize("rows, config, dtype", [
    (1, None, jnp.float32), (17, SPLIT, jnp.float32), (5, None, jnp.bfloat16), (5, SPLIT, jnp.bfloat16),
])
def test_kernel_computes_the_dequantized_product(rows, config, dtype):
    """The output-major kernel (the one fp8 weights run): one row and rows past one tile of 16, a split K range,
    float32 and bf16 activations."""
    _check_kernel(rows, config, dtype, ["output-major"])


@pytest.mark.parametrize("config", [None, SPLIT], ids=["default", "split"])
def test_input_major_kernel_agrees(config):
    _check_kernel(3, config, jnp.float32, ["input-major", "transposed"])


def test_kernel_refuses_a_weight_it_cannot_tile():
    q, s = _weight((100, 512))
    with pytest.raises(ValueError, match="does not tile"):
        fp8_gemv.fp8_gemv_nk(jnp.ones((1, 512)), q, s, jnp.float32, interpret=True)


def test_quantize_model_stores_codes_output_major_with_a_scale_per_output():
    from flax import nnx

    lin = Linear(512, (2, 192), axes=("embed", None, "mlp"), dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs=nnx.Rngs(0))  # fmt: skip
    emb = Embed(256, 512, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(1))
    w, table = lin.kernel.get_value(), emb.embedding.get_value()
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 512), jnp.float32)
    want_y, want_logits = lin(x), emb.attend(x)
    fp8_weights.quantize_model(nnx.List([lin, emb]), "xla")
    assert lin.kernel.get_value().shape == (2, 192, 512) and lin.kernel.get_value().dtype == fp8_weights.FP8
    assert lin.kernel_scale.get_value().shape == (2, 192)
    assert lin.kernel.get_metadata()["out_sharding"] == (None, "mlp", "embed")
    assert emb.embedding.get_value().dtype == fp8_weights.FP8 and emb.embedding_scale.get_value().shape == (256,)
    deq = lin.kernel.get_value().astype(jnp.float32) * lin.kernel_scale.get_value()[..., None]
    np.testing.assert_allclose(np.moveaxis(np.asarray(deq), -1, 0), np.asarray(w), atol=0.07 * float(jnp.abs(w).max()))
    # e4m3 keeps 3 mantissa bits: products within a few percent of the float ones
    for got, want in ((lin(x), want_y), (emb.attend(x), want_logits)):
        assert float(jnp.abs(got - want).max()) < 0.06 * float(jnp.abs(want).max())
    ids = jnp.array([3, 0, 255])
    np.testing.assert_allclose(np.asarray(emb(ids)), np.asarray(table[ids]), atol=0.07 * float(jnp.abs(table).max()))
    for mode in ("interpret",):  # the kernel's product is XLA's, up to float32 rounding
        lin.fp8_mode = emb.fp8_mode = mode
        np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(fp8_weights.product(
            x, lin.kernel.get_value(), lin.kernel_scale.get_value(), jnp.float32, "xla")), atol=1e-5)
    with pytest.raises(ValueError, match="already quantized"):
        fp8_weights.quantize_model(nnx.List([lin]), "xla")


def _model(runner):
    from flax import nnx

    return nnx.merge(runner.graphdef, runner.state)


PROMPTS = [{"prompt_token_ids": list(range(5, 25))}, {"prompt_token_ids": list(range(30, 70))}]  # 40 > budget 32


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs(quantization="fp8"))


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_tokens(fp8_llm):
    return completions(fp8_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_engine_on_fp8_weights_runs_xlas_product_unless_told(fp8_llm, fp8_tokens, monkeypatch):
    assert _model(fp8_llm.llm_engine.runner).model.layers[0].mlp.down_proj.fp8_mode == "xla"  # the default
    assert all(len(c[0][0]) == 8 for c in fp8_tokens)
    path = checkpoint("llama_gqa")
    monkeypatch.setenv("JAXSERVE_FP8_WEIGHTS_MODE", "pallas")
    with pytest.raises(ValueError, match="GPU kernel on one device"):
        LLM(path, **small_engine_kwargs(quantization="fp8"))
    monkeypatch.setenv("JAXSERVE_FP8_WEIGHTS_MODE", "fast")
    with pytest.raises(ValueError, match="JAXSERVE_FP8_WEIGHTS_MODE='fast'"):
        LLM(path, **small_engine_kwargs(quantization="fp8"))


def test_fp8_draft_keeps_speculation_exact():
    """The target drafting for itself in fp8: most proposals are right, some not; greedy output equals the plain
    engine's through chunked prefill, prefix caching and preemption."""
    spec = {"method": "draft_model", "model": checkpoint("llama_gqa"), "num_speculative_tokens": 3, "quantization": "fp8"}
    llm = speculative_engine(spec, num_gpu_blocks_override=24)
    draft = _model(llm.llm_engine.speculator.draft.runner)
    assert draft.model.layers[0].self_attn.qkv_proj.fp8_mode == "xla"
    shared = list(range(3, 15))
    prompts = [{"prompt_token_ids": shared + list(range(100 + 7 * i, 104 + 7 * i))} for i in range(2)]
    prompts.append({"prompt_token_ids": list(range(200, 240))})  # 40 > the 32-token budget: chunked prefill
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 12, 16)]
    plain = completions(generate(llm, prompts, params, speculate=False))
    engine = llm.llm_engine
    preempted, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    stats = engine.speculator.stats
    assert completions(generate(llm, prompts, params)) == plain
    assert engine.scheduler.num_preemptions > preempted and engine.scheduler.prefix_cache_hits > hits
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_bad_quantization_values_name_the_choices():
    from jaxserve.config import EngineArgs
    from jaxserve.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model="x", quantization="int4").validate()
    with pytest.raises(ValueError, match='only to "fp8"'):
        SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2, "quantization": "int8"})
    with pytest.raises(ValueError, match="only a draft model"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"})


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_fp8_under_tensor_parallelism_gives_one_devices_tokens(fp8_tokens):
    """TP=2 splits the codes and scales as the float weights (XLA's product: the kernel does not take a sharded
    weight) and generates what one device generates."""
    from flax import nnx

    tp = LLM(checkpoint("llama_gqa"), tensor_parallel_size=2, **small_engine_kwargs(quantization="fp8"))
    assert completions(tp.generate(PROMPTS, GREEDY, use_tqdm=False)) == fp8_tokens
    qkv = nnx.merge(tp.llm_engine.runner.graphdef, tp.llm_engine.runner.state).model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_mode == "xla" and len(qkv.kernel.get_value().sharding.device_set) == 2


def test_lora_adapters_on_fp8_base_weights(tmp_path):
    """The codes are not folded with the adapters' A (that needs float kernels): the base product, then the deltas.
    An adapter changes the output, and a batch that mixes it with the base gives each what it gives alone."""
    from lora_fixtures import make_peft_adapter

    from jaxserve import LoRARequest

    base = checkpoint("llama_gqa")
    lora = LoRARequest("b16", 1, make_peft_adapter(base, str(tmp_path / "b16"), r=16, seed=2))
    llm = LLM(base, **small_engine_kwargs(quantization="fp8", enable_lora=True, max_loras=1, max_lora_rank=16))
    assert not llm.llm_engine.runner.lora.folded
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(40, 51))}

    def gen(loras):
        return [o.outputs[0].token_ids for o in llm.generate([prompt] * len(loras), params, use_tqdm=False,
                                                             lora_request=loras)]  # fmt: skip

    alone = gen([lora])[0], gen([None])[0]
    assert alone[0] != alone[1]
    assert gen([lora, None]) == list(alone)


def test_serve_flags_reach_the_engine_args():
    """`jaxserve serve --quantization fp8 --speculative-config '{..., "quantization": "fp8"}'`: the server wraps the
    engine these args build (the engine's paths are tested above)."""
    import json

    from jaxserve.cli import build_parser, engine_args_from, parse_args

    spec = {"model": "draft", "num_speculative_tokens": 3, "quantization": "fp8"}
    ns = parse_args(build_parser(), ["serve", "target", "--quantization", "fp8", "--speculative-config", json.dumps(spec)])
    args = engine_args_from(ns)
    assert args.quantization == "fp8" and json.loads(args.speculative_config)["quantization"] == "fp8"

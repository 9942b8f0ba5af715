"""A float32 model asks for true float32 in every matmul of its step (not TF32 on a GPU); bf16 is unchanged.

The lowered StableHLO of a whole step (projections, attention of each backend, logits) carries the
precision each dot will run at, so this is checked on CPU. A GPU run of the same claim is
tests/jaxserve/test_fp32_gpu_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hlo_precision import dot_precisions, jnp_attention
from model_batch_utils import BLOCK_SIZE, NUM_BLOCKS, Chunk, block_tables, make_batch

from jaxserve.models.config import TextModelConfig
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import get_attention_fn
from jaxserve.pallas_kernels import kv_layout

LAYERS = 2


def _config(tied: bool) -> TextModelConfig:
    return TextModelConfig(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
    )  # fmt: skip


def _lowered_step(dtype, backend: str, *, tied: bool = False, **model_kw) -> str:
    """StableHLO of a jitted step like the runner's: decoder over a prefill chunk and a decode, then logits.

    The model is abstract (shapes only): lowering needs no weights and compiles nothing.
    """
    cfg = _config(tied)
    with jnp_attention():  # the jnp routes (the CPU's C++ kernel has no dots)
        attention_fn = get_attention_fn(backend, "cpu")
    model = abstract_model(cfg, dtype=dtype, attention_fn=attention_fn, **model_kw)
    graphdef, state = nnx.split(model)
    table_a, table_b = block_tables(2)
    ids, md = make_batch([Chunk(list(range(2, 9)), 0, table_a), Chunk([5], 6, table_b)])
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    page = jax.ShapeDtypeStruct(kv_layout.pages_shape(*shape, kv_layout.heads_major(backend)), dtype)  # its layout
    caches = [(page, page)] * LAYERS

    def step(state, caches, ids, md):
        m = nnx.merge(graphdef, state)
        hidden, caches = m(ids, caches, md)  # [T, D]
        return m.compute_logits(hidden[md.logits_indices]), caches  # [S, V] float32

    return jax.jit(step).lower(state, caches, ids, md).as_text()


# Dense matmuls of the step: qkv (fused), o, gate-up (fused) and down per layer, and the logits.
DENSE_DOTS = 4 * LAYERS + 1


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])
def test_float32_step_runs_every_matmul_at_highest(backend):
    counts = dot_precisions(_lowered_step(jnp.float32, backend))
    assert set(counts) == {"HIGHEST"}, counts
    assert counts["HIGHEST"] > DENSE_DOTS, f"attention's products are missing: {counts}"


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])
def test_tf32_option_asks_for_high_everywhere(backend):
    # HIGH is what XLA:GPU and Pallas's Triton lowering run as TF32.
    counts = dot_precisions(_lowered_step(jnp.float32, backend, fp32_matmul_precision="tf32"))
    assert set(counts) == {"HIGH"}, counts


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])
def test_half_precision_models_keep_the_default(backend, dtype):
    # Unchanged programs for bf16/fp16 (the option only concerns float32): no precision is forced.
    for option in ("highest", "tf32"):
        counts = dot_precisions(_lowered_step(dtype, backend, fp32_matmul_precision=option))
        assert set(counts) == {"DEFAULT"}, (option, counts)


def test_tied_embeddings_logits_are_highest_too():
    counts = dot_precisions(_lowered_step(jnp.float32, "reference", tied=True))
    assert set(counts) == {"HIGHEST"}, counts


def test_bad_option_fails_at_build_time():
    with pytest.raises(ValueError, match="fp32_matmul_precision='tf16'.*'highest', 'tf32'"):
        _lowered_step(jnp.float32, "reference", fp32_matmul_precision="tf16")

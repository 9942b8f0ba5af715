"""LoRA's A folded beside the base kernel (models/lora.py ``fold``): the same outputs as the separate shrink,
with one matmul less per projection group in the step (the engine-level check against PEFT is in
tests/jaxserve/test_lora.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from model_batch_utils import BLOCK_SIZE, NUM_BLOCKS, Chunk, block_tables, make_batch

from jaxserve.models import lora as L
from jaxserve.models.config import TextModelConfig
from jaxserve.models.layers import Linear
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import get_attention_fn

LAYERS, SLOTS, RANK = 2, 3, 4
CFG = TextModelConfig(
    architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)  # fmt: skip


def _folded_leaves(leaves: list) -> list:
    """The slot arrays as the runner passes them when folded: WA [in, out + N*P*r] in place of each A."""
    outs = L.group_outputs(CFG)
    return [
        jax.ShapeDtypeStruct((x.shape[0], math.prod(outs[g][0]) + math.prod(x.shape[1:])), x.dtype) if kind == "A" else x
        for (_, g, kind, _, _), x in zip(L.layout_leaves(CFG, SLOTS, RANK, LAYERS), leaves)
    ]  # fmt: skip


def _dots_in_step(lora: str) -> int:
    """dot_general ops in the lowered decoder step: lora is "none", "separate" or "folded"."""
    model = abstract_model(CFG, dtype=jnp.float32, attention_fn=get_attention_fn("reference", "cpu"))
    graphdef, state = nnx.split(model)
    ids, md = make_batch([Chunk([5], 6, block_tables(1)[0])])
    page = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, CFG.num_key_value_heads, CFG.head_dim), jnp.float32)
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for *_, s, _ in L.layout_leaves(CFG, SLOTS, RANK, LAYERS)]
    leaves = None if lora == "none" else _folded_leaves(leaves) if lora == "folded" else leaves

    def step(state, caches, ids, md, leaves):
        m = nnx.merge(graphdef, state)
        kw = {} if leaves is None else {"lora": L.for_layers(leaves, jnp.zeros(ids.shape, jnp.int32), LAYERS)}
        return m(ids, caches, md, **kw)[0]

    text = jax.jit(step).lower(state, [(page, page)] * LAYERS, ids, md, leaves).as_text()
    return text.count("stablehlo.dot_general")


def test_folding_saves_the_shrink_matmul_of_every_group():
    none, separate, folded = (_dots_in_step(k) for k in ("none", "separate", "folded"))
    groups = len(L.GROUPS) * LAYERS
    assert separate - none == 2 * groups  # shrink and expand per group
    assert folded - none == groups  # the expand only: the base matmul gives the shrink


def test_folded_projection_equals_base_plus_separate_delta():
    rng = np.random.default_rng(0)
    t, slots = 5, np.array([0, 1, 3, 2, 1], np.int32)  # slot 0: no adapter
    mask = L.slot_mask(jnp.asarray(slots), SLOTS)
    inputs, outputs = L.group_inputs(CFG), L.group_outputs(CFG)
    for group, (pieces, _) in L.GROUPS.items():
        n_in, out = inputs[group][0], outputs[group][0]
        linear = Linear(n_in, out, axes=(None,) * (1 + len(out)), use_bias=True, dtype=jnp.float32,
                        param_dtype=jnp.float32, rngs=nnx.Rngs(0))  # fmt: skip
        linear.bias[...] = jnp.asarray(rng.normal(size=out), jnp.float32)
        a = jnp.asarray(rng.normal(size=(n_in, SLOTS, len(pieces), RANK)), jnp.float32)
        b = jnp.asarray(rng.normal(size=(SLOTS, len(pieces), RANK, *out)), jnp.float32)
        x = jnp.asarray(rng.normal(size=(t, n_in)), jnp.float32)
        separate = L.LoRABatch({group: (a, b)}, mask).project(group, x, linear)
        folded = L.LoRABatch({group: (L.fold(linear.kernel[...], a), b)}, mask).project(group, x, linear)
        assert folded.shape == (t, *out)
        np.testing.assert_allclose(folded, separate, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(folded[0], linear(x)[0])  # slot 0: exactly the base projection

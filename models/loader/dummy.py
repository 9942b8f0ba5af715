"""Random weights from a config alone (vLLM's load_format="dummy"): for benchmarks and smoke tests."""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from jaxserve.models.config import TextModelConfig
from jaxserve.models.registry import abstract_model, build_model
from jaxserve.pallas_kernels.attention import AttentionFn


def load_dummy_model(
    cfg: TextModelConfig,
    *,
    dtype,
    attention_fn: AttentionFn,
    seed: int = 0,
    shardings_fn: Callable[[nnx.Module], Any] | None = None,
    fp32_matmul_precision: str = "highest",
) -> nnx.Module:
    """A model with HF-style random initialisation (projections ~ N(0, 0.02), norms 1), so activations
    and logits stay finite.

    The parameters are created on the device inside one jitted function: an 8B model never passes
    through host memory. ``shardings_fn(abstract_model)`` may return a state-shaped tree of shardings
    to create them already sharded.
    """
    kw = dict(dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision)
    abstract = abstract_model(cfg, **kw)
    graphdef, _ = nnx.split(abstract)
    shardings = shardings_fn(abstract) if shardings_fn is not None else None

    def init():
        model = build_model(cfg, rngs=nnx.Rngs(seed), **kw)
        return nnx.split(model)[1]  # the state; the graphdef is static and already known

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)

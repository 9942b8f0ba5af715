"""Random weights from a config alone (vLLM's load_format="dummy"): for benchmarks and smoke tests."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.weights import weights_bar
from jaxserve.models.registry import abstract_model
from jaxserve.pallas_kernels.attention import AttentionFn


def load_dummy_model(
    cfg: TextModelConfig,
    *,
    dtype,
    attention_fn: AttentionFn,
    seed: int = 0,
    shardings_fn: Callable[[nnx.Module], Any] | None = None,
    fp32_matmul_precision: str = "highest",
    progress: bool = False,
) -> nnx.Module:
    """A model with HF-style random initialisation (projections and embeddings ~ N(0, 0.02), norm scales
    1, biases 0), so activations and logits stay finite.

    Each parameter is drawn on the device by a small jitted generator, already in its sharding
    (``shardings_fn(abstract_model)``, a state-shaped tree). Generators are cached by (kind, shape,
    dtype, sharding), so the 32 layers of an 8B model share a handful of tiny programs: building one
    jitted function for the whole model instead took XLA ~100 s on an H200 to compile.
    """
    abstract = abstract_model(
        cfg, dtype=dtype, attention_fn=attention_fn, fp32_matmul_precision=fp32_matmul_precision
    )
    return fill_random(abstract, seed=seed, shardings_fn=shardings_fn, progress=progress)


def fill_random(
    abstract: nnx.Module, *, seed: int = 0, shardings_fn: Callable[[nnx.Module], Any] | None = None,
    progress: bool = False,
) -> nnx.Module:
    """``abstract`` (shapes only) with every parameter drawn as load_dummy_model says."""
    graphdef, abstract_state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    if shardings_fn is not None:
        sharding_leaves = jax.tree.leaves(shardings_fn(abstract), is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    else:
        sharding_leaves = [None] * len(leaves)
    root = jax.random.key(seed)
    arrays = []
    bar = weights_bar([leaf for _, leaf in leaves], progress)
    for i, ((path, leaf), sharding) in enumerate(zip(leaves, sharding_leaves)):
        name = jax.tree_util.keystr(path)
        is_norm = "norm" in name or "ln_q" in name  # ln_q: the vision merger's LayerNorm
        kind = "ones" if is_norm and "scale" in name else ("zeros" if "bias" in name else "normal")
        arrays.append(_generator(kind, leaf.shape, jnp.dtype(leaf.dtype), sharding)(jax.random.fold_in(root, i)))
        bar.update(arrays[-1].nbytes)
    bar.close()
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))


@functools.lru_cache(maxsize=None)
def _generator(kind: str, shape: tuple[int, ...], dtype, sharding):
    def make(key):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "zeros":
            return jnp.zeros(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(make, out_shardings=sharding)

"""Which architectures jaxserve can build, and how to build them (with real memory or only shapes)."""

from __future__ import annotations

from flax import nnx

from jaxserve.models.config import SUPPORTED_MODEL_TYPES, TextModelConfig
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.pallas_kernels.attention import AttentionFn

# model_type -> model class. Every supported type is a Llama-family variant switched by config fields.
_MODEL_CLASSES = {arch: LlamaForCausalLM for arch in SUPPORTED_MODEL_TYPES}

SUPPORTED_ARCHITECTURES = tuple(_MODEL_CLASSES)


def model_class(cfg: TextModelConfig) -> type[nnx.Module]:
    try:
        return _MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"architecture={cfg.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def build_model(cfg: TextModelConfig, *, dtype, attention_fn: AttentionFn, rngs: nnx.Rngs) -> nnx.Module:
    """A model with freshly initialised (random, HF-scale) parameters stored in ``dtype``."""
    return model_class(cfg)(cfg, dtype=dtype, param_dtype=dtype, attention_fn=attention_fn, rngs=rngs)


def abstract_model(cfg: TextModelConfig, *, dtype, attention_fn: AttentionFn) -> nnx.Module:
    """The model with ``jax.ShapeDtypeStruct`` in place of every parameter: no memory, no compute.

    Loaders use it to learn each parameter's path, shape and dtype, then fill in real weights.
    """
    return nnx.eval_shape(lambda: build_model(cfg, dtype=dtype, attention_fn=attention_fn, rngs=nnx.Rngs(0)))

"""Which architectures jaxserve can build, and how to build them (with real memory or only shapes)."""

from __future__ import annotations

import jax
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


def build_model(
    cfg: TextModelConfig, *, dtype, attention_fn: AttentionFn, rngs: nnx.Rngs, fp32_matmul_precision: str = "highest"
) -> nnx.Module:
    """A model with freshly initialised (random, HF-scale) parameters stored in ``dtype``.

    ``fp32_matmul_precision`` ("highest" or "tf32") is how a float32 model's matmuls run on a GPU
    (see jaxserve.pallas_kernels.precision); other dtypes ignore it.
    """
    return model_class(cfg)(
        cfg, dtype=dtype, param_dtype=dtype, attention_fn=attention_fn, rngs=rngs,
        fp32_matmul_precision=fp32_matmul_precision,
    )  # fmt: skip


def abstract_model(
    cfg: TextModelConfig, *, dtype, attention_fn: AttentionFn, fp32_matmul_precision: str = "highest",
    quantized_weights: bool = False,
) -> nnx.Module:
    """The model with ``jax.ShapeDtypeStruct`` in place of every parameter: no memory, no compute.

    Loaders use it to learn each parameter's path, shape and dtype, then fill in real weights.
    ``quantized_weights``: projections and embedding hold block-quantized codes (models/quantized.py).
    """
    from jaxserve.models.quantized import quantize_abstract

    def build():
        model = build_model(
            cfg, dtype=dtype, attention_fn=attention_fn, rngs=_ShapeOnlyRngs(),  # type: ignore[arg-type]
            fp32_matmul_precision=fp32_matmul_precision,
        )  # fmt: skip
        return quantize_abstract(model) if quantized_weights else model

    return nnx.eval_shape(build)


class _ShapeOnlyRngs:
    """The one part of ``nnx.Rngs`` the model's initialisers use (``rngs.params()``), without its counter.

    Only shapes survive ``eval_shape``, so every draw may use the same key. With a real ``nnx.Rngs``
    each draw updates a traced counter, and flax's update check asks the tracer for ``.sharding``, which
    makes jax build an error message by scanning the whole trace: 0.3 s of the default model's 0.5 s.
    """

    def params(self) -> jax.Array:
        return jax.random.key(0)

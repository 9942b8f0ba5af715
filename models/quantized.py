"""Block-quantized weights: a GGUF file's Q8_0, Q4_0 and Q4_1 tensors kept quantized in memory.

Each such tensor becomes int8 codes plus, per block of BLOCK values along its input axis, a float32 scale and
offset, with w = scale * code + offset exactly as llama.cpp dequantizes it (Q8_0: code = q, offset 0; Q4_0:
code = q - 8, offset 0; Q4_1: code = q, offset m). That is 1.25 bytes a weight against float32's 4, and a decode
step reads every weight once: on the CPU the native kernels (pallas_kernels/cpu_qgemm.cc) multiply by the codes
directly. Every other product (a prefill chunk of more than cpu_native.QGEMM_MAX_ROWS rows, TP, an accelerator)
dequantizes the weight inside the step and runs the float product, so each path computes the same function.

The model is built as usual, then ``quantize_abstract`` swaps the parameters of its projections and its
embedding: a Linear's ``kernel`` [in, *out] becomes the codes (same shape, int8) beside ``kernel_scale`` and
``kernel_offset`` [in / BLOCK, *out]; an Embed's ``embedding`` [V, D] becomes codes beside ``embedding_scale`` and
``embedding_offset`` [V, D / BLOCK]. They keep the original parameter's sharding axes, so TP splits them alike.
The GGUF reader hands the three as separate tensors (``weight``, ``weight_scale``, ``weight_offset``), which the
weight loader places like any other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BLOCK = 32  # values per block along a weight's input axis (GGUF's QK8_0 / QK4_0 / QK4_1)

# GGUF tensor types kept quantized (gguf.GGMLQuantizationType names) -> bytes per block of BLOCK values.
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}

# The leaves next to a quantized kernel / embedding, and the checkpoint name suffix each is read from.
SCALE, OFFSET = "_scale", "_offset"


def is_quantized(module) -> bool:
    """Whether a Linear or Embed holds codes (``quantize_abstract`` swapped its weight)."""
    return getattr(module, "weight_block", 0) > 0


def quantize_abstract(model: nnx.Module) -> nnx.Module:
    """Swap the weights of every Linear (the decoder's projections and an untied head) and Embed of ``model``
    (built under ``nnx.eval_shape``) for codes, scales and offsets of the same sharding axes."""
    from jaxserve.models.layers import Embed, Linear

    for _, module in list(nnx.iter_graph(model)):
        if isinstance(module, Linear):
            _swap(module, "kernel", block_axis=0)
        elif isinstance(module, Embed):
            _swap(module, "embedding", block_axis=1)
    return model


def _swap(module, name: str, block_axis: int) -> None:
    param = getattr(module, name)
    shape, axes = param.get_value().shape, param.get_metadata().get("out_sharding")
    if shape[block_axis] % BLOCK:
        raise ValueError(f"a quantized weight needs its input axis in blocks of {BLOCK}, got shape {shape}")
    blocks = list(shape)
    blocks[block_axis] //= BLOCK

    def new(value):
        return nnx.Param(value, out_sharding=axes, eager_sharding=False)

    setattr(module, name, new(jnp.zeros(shape, jnp.int8)))
    setattr(module, name + SCALE, new(jnp.zeros(blocks, jnp.float32)))
    setattr(module, name + OFFSET, new(jnp.zeros(blocks, jnp.float32)))
    module.weight_block = BLOCK


def dequantize(codes: jax.Array, scale: jax.Array, offset: jax.Array, axis: int) -> jax.Array:
    """The float32 weight: codes [..., n, ...] with scale and offset [..., n / B, ...], blocks along ``axis``."""
    axis = axis % codes.ndim
    n = codes.shape[axis]
    b = n // scale.shape[axis]
    split = codes.shape[:axis] + (n // b, b) + codes.shape[axis + 1 :]
    w = codes.astype(jnp.float32).reshape(split) * jnp.expand_dims(scale, axis + 1) + jnp.expand_dims(offset, axis + 1)
    return w.reshape(codes.shape)


# ----------------------------------------------------------------------------------- GGUF blocks -> codes


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """A GGUF tensor's bytes (``raw``: its blocks, row-major) as (codes int8 [N, K], scale float32 [N, K / BLOCK],
    offset float32 [N, K / BLOCK]) for its HF shape [N, K]."""
    n, k = shape
    blocks = np.asarray(raw, np.uint8).reshape(n, k // BLOCK, BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8)
        offset = np.zeros_like(d)
    else:
        packed = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        low, high = packed & 0x0F, packed >> 4  # values 0-15 of a block, then 16-31
        codes = np.concatenate([low, high], axis=-1).astype(np.int8)
        if type_name == "Q4_1":
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            codes -= 8
            offset = np.zeros_like(d)
    return codes.reshape(n, k), d, offset

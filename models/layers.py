"""Shared NNX building blocks for decoder-only text models: Linear, Embed, RMSNorm, RoPE, gated MLP.

Shape letters (used in comments and names throughout jaxserve.models):
    T  tokens in the flat ragged batch this step     S  sequences in the batch
    D  hidden size (embed)                           F  MLP intermediate size
    V  vocabulary size                               H  query heads
    K  key/value heads                               Dh head dim
    R  rotary frequencies (Dh // 2)

Logical axis names on parameters (mapped to mesh axes by one rules table elsewhere):
    "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp".
A fused heads dimension (H * Dh) is named after its heads: sharding it in contiguous chunks keeps whole
heads together whenever the mesh axis divides the head count.

Parameters are created with ``eager_sharding=False``: the names are metadata only (read with
``nnx.get_partition_spec``), so building a model never needs a mesh in context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import cpu_bf16, fp8_weights, quantized
from jaxserve.models.config import TextModelConfig
from jaxserve.pallas_kernels import cpu_native
from jaxserve.pallas_kernels.precision import matmul_precision

# HF initialises projections with normal(0, initializer_range=0.02); dummy weights use the same scale.
_INIT_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape, param_dtype, axes: tuple[str | None, ...], init: str) -> nnx.Param:
    assert len(shape) == len(axes), (shape, axes)
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, param_dtype) * _INIT_STD
    elif init == "ones":
        value = jnp.ones(shape, param_dtype)
    else:
        value = jnp.zeros(shape, param_dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). ``kernel`` is [in, *out]: Hugging Face's [out, in] weight transposed, with
    the output optionally split into several axes (``out_features`` a tuple), as the fused projections
    need: qkv [D, K, G+2, Dh] keeps each KV head's query heads, key and value together, so sharding K
    over devices gives each device whole groups; gate-up [D, 2, F] keeps gate and up columns side by side
    when F is sharded. One matmul either way (XLA flattens the output axes).

    ``precision`` of the product: None picks it from ``dtype`` (``matmul_precision``: float32 is exact on a
    GPU too, not TF32). Static, like ``dtype``: part of the graphdef.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | tuple[int, ...],
        *,
        axes: tuple[str | None, ...],
        use_bias: bool = False,
        dtype,
        param_dtype,
        precision: jax.lax.Precision | None = None,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.precision = precision if precision is not None else matmul_precision(dtype)
        out = tuple(out_features) if isinstance(out_features, (tuple, list)) else (out_features,)
        self.kernel = _param(rngs, (in_features, *out), param_dtype, axes, "normal")
        self.bias = _param(rngs, out, param_dtype, axes[1:], "zeros") if use_bias else None
        self.weight_block = 0  # > 0: ``kernel`` holds block-quantized codes (models/quantized.py)
        self.fp8_mode = None  # set: ``kernel`` holds e4m3 codes [*out, in], products run so (models/fp8_weights.py)

    def __call__(self, x: jax.Array) -> jax.Array:  # x [T, in] -> [T, *out]
        y = self.product(x, self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    def product(self, x: jax.Array, out_dtype) -> jax.Array:
        """x [T, in] @ kernel -> [T, *out] in ``out_dtype``, without the bias (float32 sums rounded once)."""
        if self.fp8_mode:
            return fp8_weights.product(x.astype(self.dtype), self.kernel[...], self.kernel_scale[...], out_dtype,
                                       self.fp8_mode, self.precision)  # fmt: skip
        if self.weight_block:
            codes, scale, offset = self.kernel[...], self.kernel_scale[...], self.kernel_offset[...]
            if cpu_native.use_qgemm(x.astype(self.dtype)):  # a decode step on the CPU: the codes read in place
                return cpu_native.qgemm(x.astype(self.dtype), codes, scale, offset).astype(out_dtype)
            if cpu_native.use_native_dequantize(x.astype(self.dtype)):  # a prefill chunk on the CPU
                kernel = cpu_native.dequantize(codes, scale, offset)
            else:
                kernel = quantized.dequantize(codes, scale, offset, axis=0).astype(self.dtype)
        else:
            kernel = self.kernel[...].astype(self.dtype)
        return cpu_bf16.matmul(x.astype(self.dtype), kernel, self.precision, out_dtype)  # bf16 on CPU: its fast form


class Embed(nnx.Module):
    """Token embedding table [V, D]; ``attend`` reuses it as a tied output head (``precision`` as in Linear)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, param_dtype, precision=None, rngs: nnx.Rngs):
        self.dtype = dtype
        self.precision = precision if precision is not None else matmul_precision(dtype)
        self.embedding = _param(rngs, (vocab_size, hidden_size), param_dtype, ("vocab", "embed"), "normal")
        self.weight_block = 0  # > 0: ``embedding`` holds block-quantized codes (models/quantized.py)
        self.fp8_mode = None  # set: ``embedding`` holds e4m3 codes with a scale per row (models/fp8_weights.py)

    def __call__(self, ids: jax.Array) -> jax.Array:  # ids [T] int32 -> [T, D]
        if self.fp8_mode:
            return fp8_weights.lookup(ids, self.embedding[...], self.embedding_scale[...], self.dtype)
        if self.weight_block:
            rows = [jnp.take(p[...], ids, axis=0) for p in (self.embedding, self.embedding_scale, self.embedding_offset)]
            return quantized.dequantize(*rows, axis=1).astype(self.dtype)
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:  # x [S, D] -> logits [S, V] float32
        if self.fp8_mode:  # the table [V, D] is the product's weight as stored: one scale per vocabulary row
            return fp8_weights.product(x.astype(self.dtype), self.embedding[...], self.embedding_scale[...],
                                       jnp.float32, self.fp8_mode, self.precision)  # fmt: skip
        if self.weight_block:
            codes, scale, offset = self.embedding[...], self.embedding_scale[...], self.embedding_offset[...]
            if cpu_native.use_qgemm(x.astype(self.dtype)):  # the tied head of a CPU decode step, read in place
                return cpu_native.qgemm_t(x.astype(self.dtype), codes, scale, offset)
            table = quantized.dequantize(codes, scale, offset, axis=1).astype(self.dtype)
        else:
            table = self.embedding[...]  # [V, D]
        if cpu_native.use_matvec(x.astype(table.dtype), table):  # one f32/bf16 row, native kernel allowed (CPU)
            return cpu_native.matvec_t(table, x.astype(table.dtype))
        if cpu_bf16.applies(table.dtype):
            return cpu_bf16.tied_logits(x.astype(table.dtype), table, self.precision)
        if x.shape[0] == 1:
            # One row (a single-stream decode): as a matrix-vector product XLA:CPU runs a real dot;
            # the row-times-transposed-table form became a loop fusion ~2x slower than the table read.
            return jnp.dot(
                table, x[0].astype(table.dtype), precision=self.precision, preferred_element_type=jnp.float32
            )[None]  # [1, V]
        return jnp.dot(x.astype(table.dtype), table.T, precision=self.precision, preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, cast back to the input dtype, then scale (that order matters
    in bf16, where scaling before the cast would round differently from the checkpoint's training)."""

    def __init__(self, dim: int, *, eps: float, param_dtype, axis_name: str = "embed"):
        self.eps = eps
        self.scale = _param(None, (dim,), param_dtype, (axis_name,), "ones")

    def __call__(self, x: jax.Array) -> jax.Array:  # x [..., dim] -> same shape and dtype
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)  # [..., 1]
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)): the SwiGLU feed-forward of Llama-family models, with gate and up as one
    matmul (``gate_up_proj`` [D, 2, F]; the loader builds it from the checkpoint's gate_proj and up_proj)."""

    def __init__(self, cfg: TextModelConfig, *, dtype, param_dtype, precision=None, rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.mlp_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = Linear(d, (2, f), axes=("embed", None, "mlp"), **kw)
        self.down_proj = Linear(f, d, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:  # x [T, D] -> [T, D]
        # lora: models/lora.py's LoRABatch, which adds the gate and up deltas into the fused output
        gate_up = self.gate_up_proj(x) if lora is None else lora.project("gate_up", x, self.gate_up_proj)  # [T, 2, F]
        h = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]  # [T, F]
        return self.down_proj(h) if lora is None else lora.project("down", h, self.down_proj)


# ----- rotary position embedding -----


def rope_inv_freq(cfg: TextModelConfig) -> np.ndarray:  # [R] float32
    """Inverse frequencies of RoPE with the config's scaling, computed in float32 as HF does.

    A config-derived constant: numpy at trace time, folded into the compiled step.
    """
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)  # [R]
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)  # [R]
    params = cfg.rope_scaling_dict()
    rope_type = cfg.rope_type
    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(_rope_param(params, "factor"))
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq.astype(np.float32)


def _rope_param(params: dict, key: str) -> float:
    if key not in params:
        raise ValueError(f"rope_scaling of type {params.get('rope_type')!r} needs {key!r}; got {params}")
    return float(params[key])


def _llama3_inv_freq(inv_freq: np.ndarray, params: dict) -> np.ndarray:  # [R] -> [R]
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by ``factor``, short ones
    kept, and the band between is interpolated smoothly."""
    factor = np.float32(_rope_param(params, "factor"))
    low = np.float32(_rope_param(params, "low_freq_factor"))
    high = np.float32(_rope_param(params, "high_freq_factor"))
    old_len = np.float32(_rope_param(params, "original_max_position_embeddings"))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq  # [R]
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # [R]
    smooth = (old_len / wavelen - low) / (high - low)  # [R]
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for the tokens' positions: [T, Dh] float32 each (halves repeated, HF layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, R]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def mrope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, mrope_section: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    """Multimodal RoPE (Qwen2-VL): positions [3, T] (temporal, height, width rows; equal for text tokens)
    -> cos, sin [T, Dh] float32. Frequency band j of ``mrope_section`` turns with row j % 3."""
    row = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # [R]: which position row each frequency uses
    assert row.shape == inv_freq.shape, (mrope_section, inv_freq.shape)
    pos = positions.astype(jnp.float32)[row]  # [R, T]
    freqs = pos.T * jnp.asarray(inv_freq)[None, :]  # [T, R]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [T, N, Dh] by cos/sin [T, Dh] (the rotate-half convention of HF checkpoints); float32
    math, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)  # [T, N, Dh]
    out = x32 * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)

"""GGUF tensors turned into model parameters on the device: dequantize, un-permute, transpose, cast.

The packed bytes go to the device as they are stored (Q4_1: 5 bits a weight instead of 32), and one small
jitted program per tensor kind decodes the blocks, undoes llama.cpp's Q/K row order, transposes to the
model's [in, out] layout and casts, in one fused pass. On the 2-core CPU the default model's weights took
~1.8 s as ``gguf.quants`` on the host (0.9 s) then a copy, transpose and cast on the device (0.9 s); here
they take ~0.25 s, plus ~0.45 s compiling the 8 small programs its tensor kinds need.

Block layouts (ggml's ``ggml-common.h``), each block covering 32 consecutive weights of a row:
  Q4_0: f16 d, 16 bytes of nibbles            w = d * (q - 8)
  Q4_1: f16 d, f16 m, 16 bytes of nibbles     w = d * q + m
  Q5_0: f16 d, u32 high bits, 16 bytes        w = d * (q - 16)
  Q5_1: f16 d, f16 m, u32 high bits, 16 bytes w = d * q + m
  Q8_0: f16 d, 32 int8                        w = d * q
Nibble bytes hold weight i in the low half of byte i and weight i + 16 in the high half. Other types
(the k-quants, i-quants) are decoded on the host by ``gguf.quants`` and take the same device program
from float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import gguf
import jax
import jax.numpy as jnp
import numpy as np

T = gguf.GGMLQuantizationType
Decoder = Callable[[jax.Array], jax.Array]  # uint8 [n_blocks, type_size] -> float32 [n_blocks, 32]


def _f16(b: jax.Array) -> jax.Array:
    """uint8 [n, 2] -> float32 [n, 1]: a little-endian half per block."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)[:, None]


def _nibbles(qs: jax.Array) -> jax.Array:
    """uint8 [n, 16] -> uint8 [n, 32]: low halves are weights 0..15, high halves 16..31."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: jax.Array) -> jax.Array:
    """uint8 [n, 4] (a little-endian u32 per block) -> uint8 [n, 32]: bit i, moved to bit 4, for weight i."""
    bits = jax.lax.bitcast_convert_type(qh, jnp.uint32)[:, None] >> jnp.arange(32, dtype=jnp.uint32)
    return ((bits & 1) << 4).astype(jnp.uint8)


def _q4_0(b):
    return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:]).astype(jnp.float32) - 8.0)


def _q4_1(b):
    return _f16(b[:, 0:2]) * _nibbles(b[:, 4:]).astype(jnp.float32) + _f16(b[:, 2:4])


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])
    return _f16(b[:, 0:2]) * (q.astype(jnp.float32) - 16.0)


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _f16(b[:, 0:2]) * q.astype(jnp.float32) + _f16(b[:, 2:4])


def _q8_0(b):
    return _f16(b[:, 0:2]) * jax.lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32)


BLOCK_DECODERS: dict[T, Decoder] = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0}

# Float types travel as their own numpy dtype and are only cast on the device.
_FLOAT_DTYPES = {T.F32: np.dtype(np.float32), T.F16: np.dtype(np.float16), T.BF16: np.dtype(jnp.bfloat16)}


def to_device(
    raw: np.ndarray,
    tensor_type: T,
    shape: tuple[int, ...],
    *,
    rope_heads: int | None,
    transpose: bool,
    dtype: Any,
    sharding: Any,
) -> jax.Array:
    """One stored tensor (``raw``: its bytes, uint8 [n_bytes]) as a parameter of ``dtype`` placed by
    ``sharding``. ``shape`` is the numpy-order shape (HF [out, in] for linear weights); ``rope_heads``
    un-permutes llama.cpp's Q/K rows for that many heads; ``transpose`` gives [in, out]."""
    if tensor_type in BLOCK_DECODERS:
        _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        packed = raw.reshape(-1, type_size)  # uint8 [n_blocks, type_size]
        kind = tensor_type
    elif tensor_type in _FLOAT_DTYPES:
        packed = raw.view(_FLOAT_DTYPES[tensor_type])
        kind = T.F32
    else:  # decoded on the host, then the float path
        packed = gguf.quants.dequantize(raw, tensor_type).reshape(-1)
        kind = T.F32
    return _program(kind, tuple(shape), rope_heads, transpose, jnp.dtype(dtype), sharding)(packed)


@functools.lru_cache(maxsize=None)
def _program(kind: T, shape: tuple[int, ...], rope_heads: int | None, transpose: bool, dtype, sharding):
    decode = BLOCK_DECODERS.get(kind)

    def convert(packed):
        w = decode(packed) if decode is not None else packed.astype(jnp.float32)
        w = w.reshape(shape)  # [out, in] or [n]
        if rope_heads:
            w = undo_rope_permutation(w, rope_heads)
        if transpose:
            w = w.T  # [in, out]
        return w.astype(dtype)

    return jax.jit(convert, out_shardings=sharding)


def undo_rope_permutation(w, num_heads: int):
    """Put llama.cpp's Q or K rows back in Hugging Face order (numpy or jax arrays).

    Within one head of d rows, HF's RoPE pairs row i with row i + d/2 (rotate-half), while
    llama.cpp's pairs rows 2i and 2i+1; so its converter stores HF row ``half*d/2 + i`` at row
    ``2*i + half``. Here each head's rows are read as (i, half) and written back as (half, i).
    Works for weights [heads*head_dim, in] and biases [heads*head_dim].
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot split {rows} Q/K rows into {num_heads} heads of pairs")
    pairs = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)

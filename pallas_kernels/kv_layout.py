"""How a KV cache lays out its pages: token-major ``[N, P, K, D]`` (the default), heads-major ``[N, K, P, D]``
(the ``xla`` backend), or an fp8 cache's V pages token-minor ``[N, K, D, P]`` (the ``pallas`` backend, switched off).

Heads-major pages, for the ``xla`` backend: its decode rows gather each sequence's pages and attend head by head,
over [K, C, D]. From token-major pages that gather moves 256-byte rows (one head's D values of one token) and
XLA:CPU emits it as an element-by-element copy; from heads-major pages it moves whole [P, D] blocks of one head
(4 KB at P=16, D=64). One sequence's 1-token decode over 256 tokens of SmolLM2-135M's widths, with the KV write
first as in the engine, 30 layers: 151 -> 97 µs a layer (docs/BENCHMARKS.md §34). The cache is the backend's
alone, so every reader and writer of an engine agrees: the engine allocates it from ``pages_shape`` and the
backend's KV write and attention read it.

Token-minor V pages of an fp8 cache:

Why a second layout: the decode kernel's P·V sums over tokens, so the tensor cores want each thread's V
operand register to hold two consecutive *tokens* of one head-dim column. A token-major fp8 tile is
contiguous along D, and Hopper's transposed shared-memory load (ldmatrix.trans) takes only 16-bit
elements, so Triton reshapes every converted tile with byte permutes: compiled for sm_90, the fp8 loop
had 208 PRMT of its 991 instructions; over token-minor V it has none and 705 in all (static SASS
counts, docs/BENCHMARKS.md §13). K keeps its layout: Q·K^T sums over D, along which K is contiguous.

Only the ``pallas`` backend off TPU reads token-minor V, and only over an fp8 cache: the switch below
decides it for the whole process (cache allocation, KV write, both Triton kernels, TP sharding), so
that every reader and writer agrees. Block ids stay axis 0, so prefix caching and block tables are
untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import fp8

# The switch: fp8 caches of the pallas backend keep V token-minor. Off: on the H200 it cost the Triton
# prefill more than it saved the Triton decode, and the faster Mosaic decode kernel (mosaic_decode.py) reads
# token-major V (docs/BENCHMARKS.md §22, §31; ``python -m jaxserve.bench.attention_fp8 --variant
# tm=fp8_v_token_minor=true``).
FP8_V_TOKEN_MINOR = False


# Backends whose caches are heads-major [N, K, P, D] (their KV write and attention read nothing else).
HEADS_MAJOR_BACKENDS = ("xla",)


def heads_major(backend: str) -> bool:
    """Whether this attention backend's cache pages are [N, K, P, D] (True) or [N, P, K, D]."""
    return backend in HEADS_MAJOR_BACKENDS


def pages_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, heads_major_pages: bool) -> tuple:
    """K (and, unless token-minor, V) pages: [N, K, P, D] when heads-major, else [N, P, K, D]."""
    if heads_major_pages:
        return (num_blocks, num_kv_heads, block_size, head_dim)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def to_heads_major(pages: jax.Array) -> jax.Array:  # [N, P, K, D] -> [N, K, P, D] (the same swap both ways)
    return jnp.swapaxes(pages, 1, 2)


def resolve(fp8_v_token_minor: bool | None) -> bool:
    """An explicit choice, or the process-wide switch for None."""
    return FP8_V_TOKEN_MINOR if fp8_v_token_minor is None else bool(fp8_v_token_minor)


def v_token_minor(kv_dtype, backend: str = "pallas", platform: str = "gpu", switch: bool | None = None) -> bool:
    """Whether V pages of this cache are token-minor: pallas backend off TPU, fp8 cache, switch on."""
    return resolve(switch) and backend == "pallas" and platform != "tpu" and fp8.is_fp8(kv_dtype)


def v_pages_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, token_minor: bool) -> tuple:
    """[N, K, D, P] when token-minor, else [N, P, K, D] (K pages are always the latter)."""
    if token_minor:
        return (num_blocks, num_kv_heads, head_dim, block_size)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def to_token_minor(v_pages: jax.Array) -> jax.Array:  # [N, P, K, D] -> [N, K, D, P]
    return jnp.transpose(v_pages, (0, 2, 3, 1))


def to_token_major(v_pages: jax.Array) -> jax.Array:  # [N, K, D, P] -> [N, P, K, D]
    return jnp.transpose(v_pages, (0, 3, 1, 2))

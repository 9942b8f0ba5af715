"""Where an fp8 cache's V pages keep their tokens: token-major ``[N, P, K, D]`` or token-minor ``[N, K, D, P]``.

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

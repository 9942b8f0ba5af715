"""Sizing and allocating the paged KV cache (one (k_pages, v_pages) pair per layer)."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

from jaxserve.config import CacheConfig
from jaxserve.pallas_kernels import kv_layout

logger = logging.getLogger("jaxserve")

_CPU_DEFAULT_KV_GIB = 1.0


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """K and V for every layer, for one block of block_size tokens."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for(
    cache: CacheConfig,
    *,
    platform: str,
    block_bytes: int,
    max_model_len: int,
    max_num_seqs: int,
    activation_reserve_bytes: int,
    device=None,
) -> int:
    """How many KV blocks to allocate: fixed by the override, else from a memory budget.

    On accelerators the budget is gpu_memory_utilization of the device's memory minus what is in use
    (weights) and a reserve for the step's activations, on ``device`` (default: the first device); under
    tensor parallelism ``block_bytes`` is what one device holds of a block. On CPU it is cpu_kv_cache_space GiB (1 GiB by
    default), bounded by what max_num_seqs full-length sequences could ever use.
    """
    blocks_per_seq = math.ceil(max_model_len / cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if platform == "cpu":
        budget = (cache.cpu_kv_cache_space or _CPU_DEFAULT_KV_GIB) * (1 << 30)
        num = int(budget // block_bytes)
        num = min(num, max_num_seqs * blocks_per_seq + 1)
        if num < blocks_per_seq:
            raise ValueError(
                f"the KV cache holds only {num} blocks of {cache.block_size} tokens ({num * cache.block_size} "
                f"tokens), less than one sequence of max_model_len={max_model_len} needs; lower max_model_len, or "
                f"raise cpu_kv_cache_space"
            )
        return num
    stats = (device or jax.devices()[0]).memory_stats() or {}
    limit = stats.get("bytes_limit", 0)
    in_use = stats.get("bytes_in_use", 0)
    budget = limit * cache.gpu_memory_utilization - in_use - activation_reserve_bytes
    num = int(budget // block_bytes)
    if num < blocks_per_seq:
        gib = 1 << 30
        raise ValueError(
            f"no room for the KV cache: gpu_memory_utilization={cache.gpu_memory_utilization} of "
            f"{limit / gib:.1f} GiB, minus {in_use / gib:.1f} GiB already in use (weights, or another engine "
            f"in this process), minus {activation_reserve_bytes / gib:.1f} GiB for activations, leaves "
            f"{max(num, 0)} blocks, fewer than one sequence of max_model_len={max_model_len} needs "
            f"({blocks_per_seq}); raise gpu_memory_utilization, lower max_model_len, or set num_gpu_blocks_override"
        )
    return num


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, sharding=None,
    v_token_minor: bool = False, v_sharding=None, heads_major: bool = False,
):  # fmt: skip
    """Zeroed pages, created in place with ``sharding`` (default device if None): list of (k_pages, v_pages),
    each [N, P, K, D], or [N, K, P, D] with ``heads_major``; with ``v_token_minor`` the V pages are [N, K, D, P]
    (pallas_kernels/kv_layout.py), placed with ``v_sharding``."""
    k_shape = kv_layout.pages_shape(num_blocks, block_size, num_kv_heads, head_dim, heads_major)
    v_shape = kv_layout.v_pages_shape(num_blocks, block_size, num_kv_heads, head_dim, v_token_minor)
    if not v_token_minor:
        v_shape = k_shape
    make_k = jax.jit(lambda: jnp.zeros(k_shape, dtype), out_shardings=sharding)
    make_v = jax.jit(lambda: jnp.zeros(v_shape, dtype), out_shardings=v_sharding if v_token_minor else sharding)
    return [(make_k(), make_v()) for _ in range(num_layers)]

"""Attention kernels over the paged KV cache, each with a pure-jnp reference beside it."""

from jaxserve.pallas_kernels.attention import ATTENTION_BACKENDS, get_attention_fn, paged_attention
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "get_attention_fn",
    "paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
]

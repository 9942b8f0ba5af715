"""Attention over a packed batch without a KV cache: what a prefill-only (pooling) step needs.

``packed_causal_attention`` has the ``attention_fn`` signature the decoder models call (pages in, pages
out), so a Llama/Qwen decoder runs as an embedder unchanged: the pages it is handed are placeholders and
come back untouched. Each token attends to the earlier tokens of its own sequence (``md.token_seq_ids``,
``md.positions``); padding tokens carry a sequence id of their own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels.metadata import AttentionMetadata


def packed_causal_attention(
    q: jax.Array,  # [T, H, Dh]
    k: jax.Array,  # [T, K, Dh]
    v: jax.Array,  # [T, K, Dh]
    k_pages: jax.Array,  # placeholder, returned as is
    v_pages: jax.Array,  # placeholder, returned as is
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (out [T, H, Dh], k_pages, v_pages)
    t, h, dh = q.shape
    kv_heads = k.shape[1]
    seq, pos = md.token_seq_ids, md.positions  # [T] each
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [T(query), T(key)]
    if sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < sliding_window
    qg = q.reshape(t, kv_heads, h // kv_heads, dh)  # [T, K, G, Dh]: query head h uses KV head h // G
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, precision=precision, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[None, None], scores * scale, -jnp.inf)  # [K, G, T, T]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v, precision=precision)  # [T, K, G, Dh]
    return out.reshape(t, h, dh), k_pages, v_pages

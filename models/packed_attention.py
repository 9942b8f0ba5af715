"""Attention over a packed batch without a KV cache: what a prefill-only (pooling) step needs.

``packed_causal_attention`` has the ``attention_fn`` signature the decoder models call (pages in, pages
out), so a Llama/Qwen decoder runs as an embedder unchanged: the pages it is handed are placeholders and
come back untouched. Each token attends to the earlier tokens of its own sequence (``md.token_seq_ids``,
``md.positions``); padding tokens carry a sequence id of their own. With ``row_len`` (bound with
functools.partial) the T tokens form rows of that many, which no sequence crosses, and attention runs per
row: [T/R, R, R] scores instead of [T, T].
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
    row_len: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (out [T, H, Dh], k_pages, v_pages)
    t, h, dh = q.shape
    kv_heads = k.shape[1]
    r = min(t, row_len or t)
    n = t // r
    seq, pos = md.token_seq_ids.reshape(n, r), md.positions.reshape(n, r)  # [N, R] each
    mask = (seq[:, :, None] == seq[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])  # [N, R(query), R(key)]
    if sliding_window is not None:
        mask &= pos[:, :, None] - pos[:, None, :] < sliding_window
    qg = q.reshape(n, r, kv_heads, h // kv_heads, dh)  # [N, R, K, G, Dh]: query head h uses KV head h // G
    k, v = k.reshape(n, r, kv_heads, dh), v.reshape(n, r, kv_heads, dh)  # [N, R, K, Dh]
    scores = jnp.einsum("ntkgd,nskd->nkgts", qg, k, precision=precision, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * scale, -jnp.inf)  # [N, K, G, R, R]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("nkgts,nskd->ntkgd", probs, v, precision=precision)  # [N, R, K, G, Dh]
    return out.reshape(t, h, dh), k_pages, v_pages

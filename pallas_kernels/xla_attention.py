"""Ragged paged attention in plain jnp, arranged so that XLA (on CPU especially) gathers little.

The reference gathers every token's whole context (T x C x K x D). In a mixed step most tokens are
prompt tokens whose sequence has nothing cached yet, so that gather is almost all waste: it is what
made the jnp path cost as much as the model itself on CPU. Here each token takes one of three routes:

1. The **last token of every sequence** (all decodes, and each prompt chunk's final token) attends
   over its sequence's pages, gathered once per sequence: S x C x K x D instead of T x C x K x D.
2. **Other tokens** (inside prompt chunks) attend to this step's keys directly (a dense T x T product,
   masked to the same sequence and causally), with no gather at all...
3. ...plus, only for the few multi-token sequences that already have cached context (later prefill
   chunks, prefix-cache hits), that cached part, one sequence per loop iteration; partial softmax
   results are merged with the usual log-sum-exp rule.

On the CPU a C++ kernel (``native``, cpu_native.py) replaces all three: every token attends over its own
sequence's pages, read in place up to its position, with no gathered copy and no masked score matrices.

Same inputs and outputs as the reference, which stays the ground truth (tests compare the two), except for the
cache's layout: this backend's pages are heads-major, ``[N, K, P, D]`` (kv_layout.py says why), so a sequence's
gathered pages come out as [K, C, D] after moving whole [P, D] blocks. Shape letters as in ``reference.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import cpu_native, fp8
from jaxserve.pallas_kernels import precision as prec
from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.reference import _MASK_VALUE, write_kv


def _partial_softmax(scores: jax.Array, visible: jax.Array, values: jax.Array, eq: str, precision):
    """Unnormalised attention over one key set: (row max, row sum, weighted values), masked rows safe."""
    scores = jnp.where(visible, scores, _MASK_VALUE)
    m = scores.max(axis=-1)
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    return m, p.sum(axis=-1), jnp.einsum(eq, p, values, precision=precision)


def _merge(a, b):
    """Combine two partial softmax results over disjoint key sets."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    w1, w2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return m, l1 * w1 + l2 * w2, o1 * w1[..., None] + o2 * w2[..., None]


def ragged_paged_attention_xla(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D] this step's keys (also already written into k_pages)
    v_new: jax.Array,  # [T, K, D]
    k_pages: jax.Array,  # [N, K, P, D] heads-major (already holding this step's keys)
    v_pages: jax.Array,  # [N, K, P, D]
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,  # of every product; None: from q's dtype (precision.resolve)
    k_scale=1.0,  # fp8 caches (fp8.py): stored values times these are the keys and values
    v_scale=1.0,
    native: bool = False,  # the C++ kernel (cpu_native.py) instead of the routes, where it reads the cache's dtype
) -> jax.Array:  # [T, H, D]
    t, h, d = q.shape
    precision = prec.resolve(precision, q.dtype)
    _, kh, p, _ = k_pages.shape
    g = h // kh
    s, b = md.block_tables.shape
    c = b * p
    f32 = jnp.float32
    md = jax.tree.map(jnp.asarray, md)  # eager mode passes numpy arrays, which traced indices cannot index

    qg = q.reshape(t, kh, g, d).astype(f32)
    if fp8.is_fp8(k_pages.dtype):
        # Route 2 reads this step's keys unquantized: round them as the cache holds them, so every route
        # sees the same keys and the backend still agrees with the reference.
        k_new = fp8.round_trip(k_new, k_scale, k_pages.dtype)
        v_new = fp8.round_trip(v_new, v_scale, v_pages.dtype)
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]  # [S]
    num_cached = md.seq_lens - q_lens  # [S] context before this step's tokens
    seq_of, pos = md.token_seq_ids, md.positions  # [T]
    real_tok = jnp.arange(t, dtype=jnp.int32) < md.query_start_loc[-1]  # [T] padding tokens are False
    if native and cpu_native.reads(k_pages.dtype):
        # The C++ kernel: every token over its own sequence's pages up to its position, read in place (the pages
        # already hold this step's keys). That is routes 1-3 below at once, with no gathered copy and no [T, T]
        # or [T, C] score matrices of which a mixed step needs only the diagonal blocks.
        out = cpu_native.paged_attention(
            qg, k_pages, v_pages, md.block_tables, seq_of, jnp.where(real_tok, pos + 1, 0), scale=scale,
            sliding_window=sliding_window,
        )
        return out.reshape(t, h, d).astype(q.dtype)
    ctx_pos = jnp.arange(c, dtype=jnp.int32)  # [C]

    # 1. Each sequence's last token over its pages (exactly the reference, on S rows), in chunks of
    # sequences up to the last real one: padding sequences (a mixed step often has half of its S rows
    # empty) then cost nothing, without another compiled shape per sequence count.
    ch = max(n for n in range(1, min(s, 16) + 1) if s % n == 0)
    q_last = qg[md.logits_indices]  # [S, K, G, D]

    def last_tokens(i, out_last):
        rows = i * ch
        tables = jax.lax.dynamic_slice_in_dim(md.block_tables, rows, ch)  # [ch, B]
        lens = jax.lax.dynamic_slice_in_dim(md.seq_lens, rows, ch)  # [ch]
        k_seq = fp8.dequantize(_gather_heads_major(k_pages, tables), k_scale)  # [ch, K, C, D]
        v_seq = fp8.dequantize(_gather_heads_major(v_pages, tables), v_scale)
        vis = ctx_pos[None, :] < lens[:, None]  # [ch, C]
        if sliding_window is not None:
            vis &= ctx_pos[None, :] > lens[:, None] - 1 - sliding_window
        # The pages as the left operand: [S, K, C, D] x [S, K, G, D] is a batched product with no relayout
        # (q on the left made XLA:CPU lay K out as [S, K, D, C], moving single elements; §29).
        sc = jnp.einsum("skcd,skgd->skcg", k_seq, jax.lax.dynamic_slice_in_dim(q_last, rows, ch), precision=precision)
        vis = vis[:, None, :, None]  # [ch, 1, C, 1]
        sc = jnp.where(vis, sc * scale, _MASK_VALUE)  # [ch, K, C, G]
        p = jnp.where(vis, jnp.exp(sc - sc.max(axis=2, keepdims=True)), 0.0)
        l, o = p.sum(axis=2), jnp.einsum("skcg,skcd->skgd", p, v_seq, precision=precision)  # [ch, K, G], [ch, K, G, D]
        return jax.lax.dynamic_update_slice_in_dim(out_last, o / jnp.maximum(l, 1e-30)[..., None], rows, 0)

    zeros_last = jnp.zeros((s, kh, g, d), f32)
    one_token = md.decode_only and md.decode_query_len == 1  # every token is its sequence's last
    if one_token and ch == s:  # one chunk: no loop (XLA:CPU pays for a while loop per layer)
        out_last = last_tokens(0, zeros_last)  # [S, K, G, D]
    else:
        num_chunks = ((md.seq_lens > 0).sum() + ch - 1) // ch  # real sequences come first
        out_last = jax.lax.fori_loop(0, num_chunks, last_tokens, zeros_last)  # [S, K, G, D]
    if one_token:
        # Every token is its sequence's only new one, hence its last: route 1 is the whole answer.
        out = jnp.where(real_tok[:, None, None, None], out_last[seq_of], 0.0)
        return out.reshape(t, h, d).astype(q.dtype)

    # 2. Every token over this step's keys of its own sequence. Padding rows of v_new may hold anything
    # (even NaN after many layers of garbage): zero them, since 0 * NaN would poison real rows.
    # Heads-first layouts ([K, T*G, D] x [K, D, T]) give XLA:CPU three plain matmuls: ~2x faster here
    # than the token-major einsum.
    qk = qg.transpose(1, 0, 2, 3).reshape(kh, t * g, d)  # [K, T*G, D]
    kn = k_new.astype(f32).transpose(1, 0, 2)  # [K, T, D]
    vn = jnp.where(real_tok[:, None, None], v_new.astype(f32), 0.0).transpose(1, 0, 2)
    vis_new = (seq_of[:, None] == seq_of[None, :]) & (pos[None, :] <= pos[:, None]) & real_tok[None, :]  # [T, T]
    if sliding_window is not None:
        vis_new &= pos[None, :] > pos[:, None] - sliding_window
    sc_new = jnp.einsum("kqd,kud->kqu", qk, kn, precision=precision).reshape(kh, t, g, t) * scale  # [K, T, G, T]
    acc = _partial_softmax(sc_new, vis_new[None, :, None, :], vn, "ktgu,kud->ktgd", precision)

    # 3. Cached context of multi-token sequences that have one: a loop over just those sequences.
    needs = (q_lens > 1) & (num_cached > 0)  # [S]
    ids = jnp.nonzero(needs, size=s, fill_value=0)[0]

    def add_cached(i, acc):
        sid = ids[i]
        kc = fp8.dequantize(_gather_heads_major(k_pages, md.block_tables[sid][None])[0], k_scale)  # [K, C, D]
        vc = fp8.dequantize(_gather_heads_major(v_pages, md.block_tables[sid][None])[0], v_scale)
        vis = (seq_of[:, None] == sid) & (ctx_pos[None, :] < num_cached[sid])  # [T, C]
        if sliding_window is not None:
            vis &= ctx_pos[None, :] > pos[:, None] - sliding_window
        sc = jnp.einsum("kqd,kcd->kqc", qk, kc, precision=precision).reshape(kh, t, g, c) * scale  # [K, T, G, C]
        return _merge(acc, _partial_softmax(sc, vis[None, :, None, :], vc, "ktgc,kcd->ktgd", precision))

    _, l, o = jax.lax.fori_loop(0, needs.sum(), add_cached, acc)
    out_other = (o / jnp.maximum(l, 1e-30)[..., None]).transpose(1, 0, 2, 3)  # [T, K, G, D]

    is_last = jnp.arange(t, dtype=jnp.int32) == md.logits_indices[seq_of]  # [T]
    out = jnp.where(is_last[:, None, None, None], out_last[seq_of], out_other)
    return out.reshape(t, h, d).astype(q.dtype)


def _gather_heads_major(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """[N, K, P, D] pages of each row's blocks [S, B] -> [S, K, B*P, D]: whole [P, D] blocks moved."""
    s, b = tables.shape
    _, kh, p, d = pages.shape
    return pages[tables].transpose(0, 2, 1, 3, 4).reshape(s, kh, b * p, d)


def paged_attention_xla(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_pages: jax.Array,  # [N, K, P, D] heads-major (kv_layout.py)
    v_pages: jax.Array,  # [N, K, P, D]
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
    k_scale=1.0,  # fp8 caches only (fp8.py)
    v_scale=1.0,
    native: bool = False,  # every token by the C++ kernel (cpu_native.py); CPU only
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The 'xla' backend: write this step's KV, then attend. Returns (out[T,H,D], k_pages, v_pages).

    The write comes first on purpose: gathering from the cache before updating it makes XLA keep the
    old cache alive and copy it whole (measured ~7x slower on CPU).
    """
    k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, md.slot_mapping, k_scale, v_scale, heads_major=True)
    out = ragged_paged_attention_xla(
        q, k_new, v_new, k_pages, v_pages, md, scale=scale, sliding_window=sliding_window, precision=precision,
        k_scale=k_scale, v_scale=v_scale, native=native,
    )
    return out, k_pages, v_pages

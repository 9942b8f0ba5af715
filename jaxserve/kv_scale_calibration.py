"""``calculate_kv_scales``: fp8 KV cache scales measured on the first prefill, then fixed for the engine's life.

An fp8 cache stores ``clip(x / scale, -max, max)`` (pallas_kernels/fp8.py). With scale 1.0 (the default when
the checkpoint carries none), keys or values beyond the format's range (448 for e4m3) are clipped, and small
ones lose precision to the format's few exponent bits. Here each layer's K and V scale becomes
``amax / fmt_max``: the largest |K| (|V|) the first step writes maps onto the format's largest value.

How, so that the scales are in place before any KV is written in fp8:

1. The engine's first step is made only of prompts starting at position 0 (nothing is cached yet), so each
   token's context is this step's own tokens of its sequence. ``calibrate`` runs the model's forward once on
   that batch with a cache-free causal attention (``_amax_attention``) swapped in for each layer's (a
   fresh, local copy of the model inside the trace: the serving graph is not touched), which instead of
   pages returns the layer's amax of K and V over the real (non-padding) tokens: ``[L, 2]`` float32.
2. The runner turns them into scales and hands them to every later step as one small replicated array
   ``[L, 2]``, which ``with_kv_scales`` writes onto the layers inside the trace: traced scalars, so setting
   them needs no recompilation (the programs were compiled at start-up with this argument in place).
3. Then the real first step runs, writing its KV with the new scales.

Off (the default) nothing of this exists: no calibration program, no extra argument, and the layers' scales
stay static floats that XLA folds as constants, exactly as before. On, a step reads ``2 L`` scalars from
memory instead of constants (nothing measurable) and the first step runs the forward twice.

vLLM divides the amax by fixed constants instead (200 for K, 100 for V), which leaves headroom for later
tokens larger than the first prefill's; here the format's max is used, so a later key or value beyond the
measured amax is clipped (never inf/NaN).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.metadata import AttentionMetadata



def attention_modules(model) -> list:
    """Each decoder layer's attention module (``model.model.layers[i].self_attn``), in layer order."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"calculate_kv_scales: {type(model).__name__} has no model.layers[*].self_attn to calibrate")
    return [layer.self_attn for layer in layers]


def with_kv_scales(model, kv_scales: jax.Array) -> None:
    """Set each layer's k_scale/v_scale to row i of ``kv_scales`` [L, 2] (traced scalars inside a jitted step)."""
    for i, attn in enumerate(attention_modules(model)):
        attn.k_scale, attn.v_scale = kv_scales[i, 0], kv_scales[i, 1]


QUERY_BLOCK = 256  # queries per block of the calibration's attention: scores [K, G, 256, T], not [K, G, T, T]


def _amax_attention(q, k, v, k_pages, v_pages, md: AttentionMetadata, *, scale, sliding_window=None,
                    precision=None, **_):  # fmt: skip
    """Causal attention of each token over its own sequence's tokens of this step, without a cache, returning
    (out [T, H, Dh], amax|K|, amax|V|) in place of the pages.

    Queries go in blocks of QUERY_BLOCK (``lax.map``), so the scores of a 2048-token first step take 1/8 of the
    memory a [T, T] tensor would: the cache already holds most of the device's memory by then. Padding tokens
    (past ``query_start_loc[-1]``) are left out of the amax and get a sequence id of their own (-1), so no real
    token attends to them."""
    t, h, dh = q.shape
    kv_heads = k.shape[1]
    real = jnp.arange(t) < md.query_start_loc[-1]  # [T]
    seq, pos = jnp.where(real, md.token_seq_ids, -1), md.positions  # [T] each
    bq = min(t, QUERY_BLOCK)
    pad = -t % bq
    blocks = lambda x, fill: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill).reshape(  # noqa: E731
        (t + pad) // bq, bq, *x.shape[1:]
    )
    qg = q.reshape(t, kv_heads, h // kv_heads, dh)  # [T, K, G, Dh]: query head h uses KV head h // G

    def block(args):  # one block of queries against all T keys
        qb, seq_b, pos_b = args  # [Bq, K, G, Dh], [Bq], [Bq]
        mask = (seq_b[:, None] == seq[None, :]) & (pos[None, :] <= pos_b[:, None])  # [Bq, T]
        if sliding_window is not None:
            mask &= pos_b[:, None] - pos[None, :] < sliding_window
        scores = jnp.einsum("tkgd,skd->kgts", qb, k, precision=precision, preferred_element_type=jnp.float32)
        # [K, G, Bq, T]. Finite: a query row of the block's padding masks every key, and must not give NaN.
        scores = jnp.where(mask, scores * scale, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("kgts,skd->tkgd", probs, v, precision=precision)  # [Bq, K, G, Dh]

    out = jax.lax.map(block, (blocks(qg, 0), blocks(seq, -2), blocks(pos, 0)))  # [T/Bq, Bq, K, G, Dh]
    amax = lambda x: jnp.max(jnp.where(real[:, None, None], jnp.abs(x.astype(jnp.float32)), 0.0))  # noqa: E731
    return out.reshape(-1, h, dh)[:t], amax(k), amax(v)


def _calibrate(graphdef, treedef, params, input_ids, md: AttentionMetadata) -> jax.Array:  # -> [L, 2] f32
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    attns = attention_modules(model)
    for attn in attns:
        attn.attention_fn = _amax_attention  # a local copy of the model: the serving graphdef keeps its own
    placeholder = jnp.zeros((), jnp.float32)  # not fp8: the model passes no scales, and no page is read
    _, amaxes = model(input_ids, [(placeholder, placeholder)] * len(attns), md)
    return jnp.stack([jnp.stack(kv) for kv in amaxes])  # [L, 2]


def calibrate(graphdef, treedef, params, input_ids: jax.Array, md: AttentionMetadata) -> jax.Array:
    """Per-layer (amax|K|, amax|V|) [L, 2] float32 of one batch of prompts that all start at position 0.
    Runs once per engine, so it is compiled for this one shape and not kept."""
    return jax.jit(functools.partial(_calibrate, graphdef, treedef))(params, input_ids, md)


def scales_from_amax(amax, kv_dtype) -> list[tuple[float, float]]:
    """amax [L, 2] -> per-layer (k_scale, v_scale): amax / the format's max; 1.0 where a layer saw only zeros."""
    big = float(jnp.finfo(kv_dtype).max)
    out = []
    for k, v in jax.device_get(amax).tolist():
        out.append(tuple(float(a) / big if 0 < a < math.inf else 1.0 for a in (k, v)))
    return out

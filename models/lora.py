"""Multi-LoRA on the device: adapter weights stacked in slots, applied to a mixed batch in one pass.

Every projection a LoRA adapter may target (q/k/v/o/gate/up/down) gets, per layer, its adapters' weights
stacked over ``N = max_loras + 1`` slots; slot 0 stays zeros and means "no adapter". Each token carries its
slot index, so one step serves requests of different adapters (and none) together, as Punica / S-LoRA do,
without merging any adapter into the base weights and without a pass per adapter.

Projections are grouped by the base matmul they add to (``GROUPS``): q, k and v add into the fused
``qkv_proj`` output ``[T, K, G+2, Dh]``, gate and up into ``gate_up_proj`` ``[T, 2, F]``. A group's pieces
share their input, so their A matrices are one matrix: one "shrink" matmul per group.

    shrink  xa[T, N, P, r] = x[T, in] @ A[in, N*P*r], then zeroed outside each token's own slot
    expand  delta_p[T, out_p] = xa[:, :, p].reshape(T, N*r) @ B_p[N*r, out_p]   (one matmul per piece)

The masked slots contribute exact zeros, so each token gets exactly its own adapter's delta. The work is
dense over all N slots: it grows with max_loras, not with the adapters a step really uses; at rank 16 and
N = 5 on the 8B shape that is a few per cent of the base FLOPs and bytes. Ranks below ``max_lora_rank``
are zero-padded (exact), and the adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded
into B on the host.

Sharding under TP: A is sharded like the layer's input (its ``in`` axis carries the kernel's input axis
name), B like its output; XLA adds the all-reduce after a sharded-input shrink (o_proj, down_proj).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.config import TextModelConfig

# group -> (pieces in the fused output's order, the base module the group adds to)
GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv": (("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj"),
    "o": (("o_proj",), "self_attn.o_proj"),
    "gate_up": (("gate_proj", "up_proj"), "mlp.gate_up_proj"),
    "down": (("down_proj",), "mlp.down_proj"),
}
TARGET_MODULES = tuple(p for pieces, _ in GROUPS.values() for p in pieces)
PIECE_GROUP = {p: g for g, (pieces, _) in GROUPS.items() for p in pieces}


@dataclasses.dataclass(frozen=True)
class PieceShape:
    group: str
    index: int  # position among the group's pieces
    out_shape: tuple[int, ...]  # the piece's output as the fused projection lays it out
    out_axes: tuple[str | None, ...]  # logical axis names of out_shape


def group_inputs(cfg: TextModelConfig) -> dict[str, tuple[int, str]]:
    """group -> (input features, the input's logical axis name)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": (d, "embed"),
        "o": (cfg.num_attention_heads * cfg.head_dim, "q_heads"),
        "gate_up": (d, "embed"),
        "down": (f, "mlp"),
    }


def piece_shapes(cfg: TextModelConfig) -> dict[str, PieceShape]:
    """Each target module's output shape in the fused layout (q as [K, G, Dh]: KV head k's G query heads)."""
    k, dh, d, f = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    g = cfg.num_attention_heads // k
    return {
        "q_proj": PieceShape("qkv", 0, (k, g, dh), ("kv_heads", None, "head_dim")),
        "k_proj": PieceShape("qkv", 1, (k, dh), ("kv_heads", "head_dim")),
        "v_proj": PieceShape("qkv", 2, (k, dh), ("kv_heads", "head_dim")),
        "o_proj": PieceShape("o", 0, (d,), ("embed",)),
        "gate_proj": PieceShape("gate_up", 0, (f,), ("mlp",)),
        "up_proj": PieceShape("gate_up", 1, (f,), ("mlp",)),
        "down_proj": PieceShape("down", 0, (d,), ("embed",)),
    }


def layer_layout(cfg: TextModelConfig, num_slots: int, rank: int) -> dict[str, Any]:
    """One layer's arrays as {group: (A, (B_p, ...))} of (shape, logical axes) pairs.

    A [in, N, P, r]: sharded like the input; B_p [N, r, *out_p]: sharded like the output.
    """
    inputs, pieces = group_inputs(cfg), piece_shapes(cfg)
    out = {}
    for group, (names, _) in GROUPS.items():
        n_in, in_axis = inputs[group]
        a = ((n_in, num_slots, len(names), rank), (in_axis, None, None, None))
        bs = tuple(((num_slots, rank, *pieces[p].out_shape), (None, None, *pieces[p].out_axes)) for p in names)
        out[group] = (a, bs)
    return out


def layout_leaves(cfg: TextModelConfig, num_slots: int, rank: int, num_layers: int) -> list[tuple[str, str, tuple, tuple]]:
    """The flat order of every LoRA array: (layer index, group, piece or "A", shape, axes) per leaf."""
    leaves = []
    layout = layer_layout(cfg, num_slots, rank)
    for layer in range(num_layers):
        for group, (names, _) in GROUPS.items():
            a, bs = layout[group]
            leaves.append((layer, group, "A", *a))
            leaves += [(layer, group, p, *b) for p, b in zip(names, bs)]
    return leaves


def unflatten_layers(flat: list[jax.Array], num_layers: int) -> list[dict[str, tuple[jax.Array, tuple[jax.Array, ...]]]]:
    """The flat list (``layout_leaves`` order) -> per layer {group: (A, (B_p, ...))}."""
    it = iter(flat)
    layers = []
    for _ in range(num_layers):
        layer = {}
        for group, (names, _) in GROUPS.items():
            a = next(it)
            layer[group] = (a, tuple(next(it) for _ in names))
        layers.append(layer)
    return layers


@dataclasses.dataclass
class LoRABatch:
    """What one layer's projections need: that layer's slot weights and the tokens' slot mask."""

    weights: dict[str, tuple[jax.Array, tuple[jax.Array, ...]]]  # {group: (A [in, N, P, r], (B_p [N, r, *out_p]))}
    mask: jax.Array  # [T, N] float32: one-hot of each token's slot (slot 0: no adapter)

    def deltas(self, group: str, x: jax.Array, precision=None) -> list[jax.Array]:
        """x [T, in] -> one delta per piece of ``group``, [T, *out_p] in x's dtype (``precision``: the base
        projection's, so a float32 model's deltas are float32 on a GPU too)."""
        a, bs = self.weights[group]
        n_in, n, p, r = a.shape
        t = x.shape[0]
        xa = jnp.dot(x, a.reshape(n_in, n * p * r).astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
        xa = xa.reshape(t, n, p, r) * self.mask[:, :, None, None]  # [T, N, P, r]: other slots' columns zeroed
        xa = xa.astype(x.dtype)
        out = []
        for i, b in enumerate(bs):
            b2 = b.reshape(n * r, -1).astype(x.dtype)  # [N*r, out_p]
            y = jnp.dot(xa[:, :, i].reshape(t, n * r), b2, precision=precision, preferred_element_type=jnp.float32)
            out.append(y.reshape(t, *b.shape[2:]).astype(x.dtype))
        return out


def slot_mask(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    """[T] int32 slot index per token -> [T, N] float32 one-hot."""
    return (slot_ids[:, None] == jnp.arange(num_slots, dtype=slot_ids.dtype)[None, :]).astype(jnp.float32)


def for_layers(flat: list[jax.Array] | None, slot_ids: jax.Array | None, num_layers: int) -> list[LoRABatch | None]:
    """Per layer LoRABatch (or None everywhere when the step has no LoRA)."""
    if flat is None:
        return [None] * num_layers
    layers = unflatten_layers(flat, num_layers)
    num_slots = layers[0]["o"][0].shape[1]
    mask = slot_mask(slot_ids, num_slots)
    return [LoRABatch(w, mask) for w in layers]

"""Multi-LoRA on the device: adapter weights stacked in slots, applied to a mixed batch in one pass.

Every projection a LoRA adapter may target (q/k/v/o/gate/up/down) gets, per layer, its adapters' weights
stacked over ``N = max_loras`` slots. Each token carries its slot index (1..N; 0 means "no adapter"), so one
step serves requests of different adapters (and none) together, as Punica / S-LoRA do, without merging any
adapter into the base weights and without a pass per adapter. Slot 0 needs no zero weights stored or
multiplied: its tokens' mask row is all zeros.

Projections are grouped by the base matmul they add to (``GROUPS``): q, k and v add into the fused
``qkv_proj`` output ``[T, K, G+2, Dh]``, gate and up into ``gate_up_proj`` ``[T, 2, F]``. A group's P pieces
share their input, so per group and layer there are two matmuls, whatever the pieces:

    shrink  xa[T, N, P, r] = x[T, in] @ A[in, N*P*r], then zeroed outside each token's own slot
    expand  delta[T, *out] = xa.reshape(T, N*P*r) @ B[N*P*r, *out]

On one device (the runner's choice, ``ModelRunner._lora_slots``) each group's A is folded beside its base
kernel, ``WA [in, out + N*P*r]`` (``fold``), so the base matmul gives the shrink too and only the expand is
extra: per layer 4 matmuls more than the plain step instead of 8, at the same bytes (each launch costs a
few microseconds, which in a single-stream decode step outweighs the adapters' bytes). The base kernels then
live only inside WA; a slot write updates its A columns in place. Under TP the base output axes are sharded
and A's are not, so WA could not be laid out like both: there the shrink stays a matmul of its own.

B is laid out in the fused output's own layout, block-structured: piece p's r rows are non-zero only in
that piece's output slice (q's columns for q_proj's rows, and so on). So the delta adds straight onto the
fused output, and q/k/v (gate/up) need one expand, not one each; the zeros cost (P - 1) / P of B's bytes,
which are small (rank x out). Masked slots and zero blocks contribute exact zeros, so each token gets exactly
its own adapter's per-piece deltas. The work is dense over all N slots: it grows with max_loras, not with
the adapters a step really uses; at rank 16 and N = 4 on the 8B shape that is about 4% of the base
FLOPs and bytes. Ranks below ``max_lora_rank`` are zero-padded (exact), and the adapter's scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B on the host.

Sharding under TP: A is sharded like the layer's input (its ``in`` axis carries the kernel's input axis
name), B like its output (the base kernel's output axes); XLA adds the all-reduce after a sharded-input
shrink (o_proj, down_proj).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxserve.models import cpu_bf16
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


def group_inputs(cfg: TextModelConfig) -> dict[str, tuple[int, str]]:
    """group -> (input features, the input's logical axis name)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "qkv": (d, "embed"),
        "o": (cfg.num_attention_heads * cfg.head_dim, "q_heads"),
        "gate_up": (d, "embed"),
        "down": (f, "mlp"),
    }


def group_outputs(cfg: TextModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """group -> (the fused output's shape, its logical axes): the base kernel's output dims."""
    k, dh, d, f = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    g = cfg.num_attention_heads // k
    return {
        "qkv": ((k, g + 2, dh), ("kv_heads", None, "head_dim")),
        "o": ((d,), ("embed",)),
        "gate_up": ((2, f), (None, "mlp")),
        "down": ((d,), ("embed",)),
    }


def piece_out_shape(cfg: TextModelConfig, piece: str) -> tuple[int, ...]:
    """A piece's output as its slice of the group's fused output ([K, G, Dh] for q: KV head k's G query heads)."""
    k, dh = cfg.num_key_value_heads, cfg.head_dim
    return {
        "q_proj": (k, cfg.num_attention_heads // k, dh), "k_proj": (k, dh), "v_proj": (k, dh),
        "o_proj": (cfg.hidden_size,), "gate_proj": (cfg.intermediate_size,), "up_proj": (cfg.intermediate_size,),
        "down_proj": (cfg.hidden_size,),
    }[piece]


def piece_index(cfg: TextModelConfig, piece: str) -> tuple:
    """Where a piece's output sits in its group's fused output (an index into [*out])."""
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    every = slice(None)
    return {
        "q_proj": (every, slice(0, g), every), "k_proj": (every, g, every), "v_proj": (every, g + 1, every),
        "o_proj": (every,), "gate_proj": (0, every), "up_proj": (1, every), "down_proj": (every,),
    }[piece]


def layer_layout(cfg: TextModelConfig, num_slots: int, rank: int) -> dict[str, tuple[tuple, tuple]]:
    """One layer's arrays as {group: ((A shape, A axes), (B shape, B axes))}.

    A [in, N, P, r]: sharded like the input; B [N, P, r, *out]: sharded like the output.
    """
    inputs, outputs = group_inputs(cfg), group_outputs(cfg)
    out = {}
    for group, (names, _) in GROUPS.items():
        n_in, in_axis = inputs[group]
        shape, axes = outputs[group]
        out[group] = (
            ((n_in, num_slots, len(names), rank), (in_axis, None, None, None)),
            ((num_slots, len(names), rank, *shape), (None, None, None, *axes)),
        )
    return out


def layout_leaves(cfg: TextModelConfig, num_slots: int, rank: int, num_layers: int) -> list[tuple]:
    """The flat order of every LoRA array: (layer index, group, "A" or "B", shape, axes) per leaf."""
    leaves = []
    layout = layer_layout(cfg, num_slots, rank)
    for layer in range(num_layers):
        for group in GROUPS:
            a, b = layout[group]
            leaves += [(layer, group, "A", *a), (layer, group, "B", *b)]
    return leaves


def unflatten_layers(flat: list[jax.Array], num_layers: int) -> list[dict[str, tuple[jax.Array, jax.Array]]]:
    """The flat list (``layout_leaves`` order) -> per layer {group: (A, B)}."""
    it = iter(flat)
    return [{group: (next(it), next(it)) for group in GROUPS} for _ in range(num_layers)]


@dataclasses.dataclass
class LoRABatch:
    """What one layer's projections need: that layer's slot weights and the tokens' slot mask.

    A group's first array is either A [in, N, P, r] (the base projection runs apart: two extra matmuls) or,
    folded (``fold_base``), the base kernel with every slot's A beside it, WA [in, out + N*P*r]: one matmul
    then gives the base output and the shrink together, and only the expand is extra.
    """

    weights: dict[str, tuple[jax.Array, jax.Array]]  # {group: (A [in, N, P, r] or WA [in, out + N*P*r], B [N, P, r, *out])}
    mask: jax.Array  # [T, N] float32: one-hot of each token's slot; all zeros for slot 0 (no adapter)

    def project(self, group: str, x: jax.Array, linear) -> jax.Array:
        """The base projection ``linear`` (a layers.Linear) of x [T, in] plus each token's adapter delta:
        [T, *out] in the projection's dtype."""
        a, b = self.weights[group]
        if a.ndim == 4:  # not folded: the base matmul, then the shrink and the expand
            return linear(x) + self.delta(group, x, linear.precision)
        t, out = x.shape[0], b.shape[3:]
        n_out = math.prod(out)
        y = cpu_bf16.matmul(
            x.astype(linear.dtype), a.astype(linear.dtype), linear.precision, linear.dtype
        )  # [T, out + N*P*r]: the base output, then every slot's shrink (as Linear computes it)
        base = y[:, :n_out].reshape(t, *out)
        if linear.bias is not None:
            base = base + linear.bias[...].astype(linear.dtype)
        return base + self._expand(y[:, n_out:], b, linear.precision, linear.dtype)

    def delta(self, group: str, x: jax.Array, precision=None) -> jax.Array:
        """x [T, in] -> the group's delta [T, *out] in x's dtype, to add onto the base projection's fused output
        (``precision``: the base projection's, so a float32 model's delta is float32 on a GPU too)."""
        a, b = self.weights[group]
        n_in, n, p, r = a.shape
        xa = jnp.dot(x, a.reshape(n_in, n * p * r).astype(x.dtype), precision=precision, preferred_element_type=jnp.float32)
        return self._expand(xa, b, precision, x.dtype)

    def _expand(self, xa: jax.Array, b: jax.Array, precision, dtype) -> jax.Array:
        """xa [T, N*P*r] (every slot's shrink) -> delta [T, *out] in ``dtype``: other slots' columns zeroed
        (exact: the mask is 0 or 1), then one matmul onto the fused output's layout."""
        t, (n, p, r) = xa.shape[0], b.shape[:3]
        xa = xa.reshape(t, n, p * r) * self.mask[:, :, None].astype(xa.dtype)  # [T, N, P*r]
        y = jnp.dot(
            xa.reshape(t, n * p * r).astype(dtype), b.reshape(n * p * r, -1).astype(dtype),
            precision=precision, preferred_element_type=jnp.float32,
        )  # [T, out]
        return y.reshape(t, *b.shape[3:]).astype(dtype)


def fold(kernel: jax.Array, a: jax.Array) -> jax.Array:
    """A base kernel [in, *out] and its group's A [in, N, P, r] -> WA [in, out + N*P*r], what ``LoRABatch.project``
    multiplies by once for the base output and every slot's shrink (the base columns first)."""
    n_in = kernel.shape[0]
    return jnp.concatenate([kernel.reshape(n_in, -1), a.reshape(n_in, -1).astype(kernel.dtype)], axis=1)


def slot_mask(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    """[T] int32 slot per token (1..N, 0: none) -> [T, N] float32 one-hot of slot - 1 (slot 0: a zero row)."""
    return (slot_ids[:, None] - 1 == jnp.arange(num_slots, dtype=slot_ids.dtype)[None, :]).astype(jnp.float32)


def for_layers(flat: list[jax.Array] | None, slot_ids: jax.Array | None, num_layers: int) -> list[LoRABatch | None]:
    """Per layer LoRABatch (or None everywhere when the step has no LoRA)."""
    if flat is None:
        return [None] * num_layers
    layers = unflatten_layers(flat, num_layers)
    num_slots = layers[0]["o"][1].shape[0]  # B [N, P, r, *out]
    mask = slot_mask(slot_ids, num_slots)
    return [LoRABatch(w, mask) for w in layers]

"""fp8 KV cache scales stored in a checkpoint: ``model.layers.N.self_attn.k_scale`` / ``v_scale``.

Checkpoints quantized for an fp8 KV cache (llm-compressor, vLLM's own) store one scalar per layer for K
and one for V; older ones store a single ``kv_scale`` for both. They are not parameters: they become each
attention layer's static ``k_scale``/``v_scale`` (models/llama.py), 1.0 where the checkpoint has none.
They matter only with ``kv_cache_dtype`` fp8*; a model-dtype cache ignores them.

Other formats: a ``jaxserve convert`` directory keeps them in its metadata file (``kv_scales``, see
orbax_format.py), so they survive conversion. GGUF files carry none: llama.cpp quantizes its KV cache at run
time (per-block scales of q8_0/q4_0 caches, nothing per layer in the file), so a GGUF model runs an fp8 cache
at scale 1.0, or with ``calculate_kv_scales``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.kv_scale")
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|kv)_scale$")


def read_kv_scales(tensors: Any) -> dict[int, tuple[float, float]]:
    """layer -> (k_scale, v_scale) for the layers whose scales ``tensors`` (a name -> array mapping) holds."""
    if not isinstance(tensors, Mapping):
        return {}  # a stream of pairs (GGUF) carries no KV scales
    found: dict[int, dict[str, float]] = {}
    for name in tensors.keys():
        m = _NAME.match(name)
        if m is None:
            continue
        value = float(np.asarray(tensors[name], np.float32).reshape(-1)[0])
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"checkpoint tensor {name!r} = {value} is not a usable KV cache scale (must be > 0)")
        found.setdefault(int(m.group(1)), {})[m.group(2)] = value
    out = {}
    for layer, s in found.items():
        both = s.get("kv", 1.0)
        out[layer] = (s.get("k", both), s.get("v", both))
    return out


def apply_kv_scales(model: Any, scales: dict[int, tuple[float, float]]) -> None:
    """Set each listed layer's attention ``k_scale``/``v_scale`` (static floats, before the model is split)."""
    layers = model.model.layers
    for layer, (k, v) in scales.items():
        if layer >= len(layers):
            raise ValueError(f"checkpoint has KV cache scales for layer {layer}, but the model has {len(layers)} layers")
        layers[layer].self_attn.k_scale, layers[layer].self_attn.v_scale = k, v


def model_kv_scales(model: Any) -> dict[int, tuple[float, float]]:
    """layer -> (k_scale, v_scale) of a built model, for the layers whose scales are not the default 1.0."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        k, v = float(layer.self_attn.k_scale), float(layer.self_attn.v_scale)
        if (k, v) != (1.0, 1.0):
            out[i] = (k, v)
    return out

"""Read a Hugging Face PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into the
slot layout of jaxserve.models.lora, on the host (numpy).

What is supported: LoRA on any of q/k/v/o/gate/up/down_proj of a Llama-family model, any rank up to
``max_lora_rank``, ``lora_alpha`` with plain or rsLoRA scaling (``use_rslora``). Anything else (DoRA,
embedding or lm_head targets, modules_to_save, per-module rank or alpha patterns, trained biases) is an
error naming the field, since serving it silently without would give wrong outputs.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from jaxserve.models.lora import (
    GROUPS, PIECE_GROUP, TARGET_MODULES, group_inputs, layout_leaves, piece_index, piece_out_shape,
)  # fmt: skip

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head", "embed", "wte", "norm")


class LoRAAdapter:
    """One adapter on the host: its arrays for one slot, in ``layout_leaves`` order without the slot axis
    (A [in, P, R], B [P, R, *out]; R = max_lora_rank, zero-padded; B scaled, each piece's rows only in its
    output slice)."""

    def __init__(self, name: str, rank: int, scaling: float, targets: tuple[str, ...], arrays: list[np.ndarray]):
        self.name = name
        self.rank = rank
        self.scaling = scaling
        self.targets = targets
        self.arrays = arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def read_adapter_config(path: str, max_lora_rank: int) -> dict[str, Any]:
    """The adapter's config, checked: raises ValueError naming the field and what would work."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: no {CONFIG_FILE} there (a Hugging Face PEFT adapter directory is needed)")
    with open(cfg_path) as f:
        cfg = json.load(f)

    def bad(field: str, want: str) -> ValueError:
        return ValueError(f"LoRA adapter {path!r}: {field}={cfg.get(field)!r} is not supported: {want}")

    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise bad("peft_type", "only LORA adapters can be served")
    if cfg.get("use_dora"):
        raise bad("use_dora", "DoRA adapters are not served; merge the adapter or train plain LoRA")
    if cfg.get("modules_to_save"):
        raise bad("modules_to_save", "only LoRA matrices are served, not fully trained modules")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise bad(field, "every module must use the adapter's one r and lora_alpha")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", "only bias='none' adapters are served")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "only nn.Linear targets (fan_in_fan_out=false) are served")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise bad("r", "must be a positive integer")
    if r > max_lora_rank:
        raise bad("r", f"the rank {r} is above max_lora_rank={max_lora_rank}; raise --max-lora-rank to at least {r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            # A regex: which modules it names is read from the weight file instead.
            targets = [m for m in TARGET_MODULES if re.search(targets, f"layers.0.x.{m}")]
    elif isinstance(targets, (list, tuple)):
        names = [str(t).rsplit(".", 1)[-1] for t in targets]
        unknown = [t for t in names if t not in TARGET_MODULES]
        if unknown:
            want = f"target modules must be among {list(TARGET_MODULES)}"
            if any(u in _UNSUPPORTED_TARGETS or "embed" in u or "head" in u for u in unknown):
                want = "embedding and lm_head targets are not served; " + want
            raise bad("target_modules", want)
    else:
        raise bad("target_modules", "a list of module names (or 'all-linear') is needed")
    return cfg


def scaling_of(cfg: dict[str, Any]) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
    r = cfg["r"]
    alpha = cfg.get("lora_alpha", 8)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def check_adapter(path: str, text_config, max_lora_rank: int) -> tuple[dict[str, Any], dict[tuple[int, str], dict[str, str]]]:
    """Check an adapter against the model from its config and the weight file's header only (no tensor data is
    read: fast enough to run before a request is accepted). Returns (config, {(layer, module): {"A"/"B": name}}).
    Raises ValueError naming the field or tensor and what would work."""
    from safetensors import safe_open

    cfg = read_adapter_config(path, max_lora_rank)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        have = ", ".join(sorted(os.listdir(path)))
        raise ValueError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE} (found: {have}); save it with safe_serialization=True")
    with safe_open(weights_path, framework="numpy") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    rank, num_layers = cfg["r"], text_config.num_hidden_layers
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        if "lora_magnitude_vector" in name:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name} is DoRA's (use_dora is not supported)")
        if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name} targets an embedding or lm_head, which is not served")
        m = _TENSOR.search(name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name} is not a LoRA A/B matrix of {list(TARGET_MODULES)}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in PIECE_GROUP:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name} targets {module}; served targets: {list(TARGET_MODULES)}")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name} is for layer {layer}, the model has {num_layers}")
        found.setdefault((layer, module), {})[ab] = name

    inputs = group_inputs(text_config)
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        n_in, n_out = inputs[PIECE_GROUP[module]][0], math.prod(piece_out_shape(text_config, module))
        a_shape, b_shape = shapes[ab["A"]], shapes[ab["B"]]
        if a_shape != (rank, n_in) or b_shape != (n_out, rank):
            raise ValueError(
                f"LoRA adapter {path!r}: layer {layer} {module}: lora_A {a_shape} / lora_B {b_shape}, "
                f"expected ({rank}, {n_in}) / ({n_out}, {rank}) for r={rank} on this model: is it this model's adapter?"
            )
    return cfg, found


def load_adapter(path: str, text_config, max_lora_rank: int, dtype) -> LoRAAdapter:
    """Check, read and lay out one adapter for a slot (host arrays in ``dtype``). Thread-safe: the engine runs it
    in a background thread so that requests without this adapter keep stepping meanwhile."""
    from safetensors.numpy import load_file

    cfg, names = check_adapter(path, text_config, max_lora_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    rank, scaling = cfg["r"], scaling_of(cfg)
    num_layers = text_config.num_hidden_layers
    found = {key: {ab: np.asarray(tensors[name], np.float32) for ab, name in ab_names.items()}
             for key, ab_names in names.items()}  # fmt: skip

    arrays = []
    for layer, group, kind, shape, _ in layout_leaves(text_config, 1, max_lora_rank, num_layers):
        names = GROUPS[group][0]
        if kind == "A":  # [in, 1, P, R] -> [in, P, R]
            a = np.zeros((shape[0], len(names), max_lora_rank), np.float32)
            for i, p in enumerate(names):
                if (layer, p) in found:
                    a[:, i, :rank] = found[(layer, p)]["A"].T
            arrays.append(a.astype(dtype))
        else:  # [1, P, R, *out] -> [P, R, *out]; piece i's rows only in its slice of the fused output
            b = np.zeros(shape[1:], np.float32)
            for i, p in enumerate(names):
                if (layer, p) in found:
                    b_t = (found[(layer, p)]["B"].T * np.float32(scaling)).reshape(rank, *piece_out_shape(text_config, p))
                    b[(i, slice(0, rank), *piece_index(text_config, p))] = b_t
            arrays.append(b.astype(dtype))
    targets = tuple(sorted({module for _, module in found}))
    return LoRAAdapter(os.path.basename(os.path.normpath(path)), rank, scaling, targets, arrays)

"""Random LoRA adapters in PEFT format for any model config (benchmarks; no torch or peft needed)."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from jaxserve.models.lora import PIECE_GROUP, TARGET_MODULES, group_inputs, piece_out_shape


def write_dummy_adapter(path: str, text_config, rank: int, seed: int = 0, targets=TARGET_MODULES, std: float = 0.01) -> str:
    """An adapter of ``rank`` on ``targets`` of every layer, A and B random (B non-zero, unlike a fresh PEFT
    adapter, so the work is real), float16 on disk; returns ``path``."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none",
              "use_rslora": False, "use_dora": False, "lora_dropout": 0.0}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    rng = np.random.default_rng(seed)
    inputs = group_inputs(text_config)
    tensors = {}
    for layer in range(text_config.num_hidden_layers):
        for module in targets:
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            n_in, n_out = inputs[PIECE_GROUP[module]][0], math.prod(piece_out_shape(text_config, module))
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in), np.float32) * std).astype(np.float16)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank), np.float32) * std).astype(np.float16)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path

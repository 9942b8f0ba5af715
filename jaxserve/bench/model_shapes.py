"""Config-only model directories for dummy-weight benchmarks (no download): `python -m
jaxserve.bench.model_shapes llama3-8b DIR` writes DIR/config.json, then `--model DIR --load-format dummy`."""

from __future__ import annotations

import json
import os
import sys

SHAPES = {
    # The shape ../shared/bench/hf_baseline.py measures transformers on.
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001, hidden_act="silu", torch_dtype="bfloat16",
    ),
}


def write_shape(name: str, out_dir: str) -> str:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(SHAPES[name], f, indent=1)
    return out_dir


if __name__ == "__main__":
    print(write_shape(sys.argv[1], sys.argv[2]))

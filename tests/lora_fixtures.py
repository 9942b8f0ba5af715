"""Random PEFT LoRA adapters for the tiny checkpoints, and HF + PEFT greedy references.

TEST-ONLY: imports torch and peft. B is drawn non-zero (PEFT initialises it to zeros, which would make an
adapter a no-op and every parity test pass trivially).
"""

from __future__ import annotations

import functools
import os

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_path, out_path, *, r: int, targets=ALL_TARGETS, alpha: int = 16, seed: int = 0,
                      use_rslora: bool = False, scale: float = 0.1) -> str:  # fmt: skip
    """Write a random LoRA adapter of ``base_path`` in PEFT format to ``out_path``; returns ``out_path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.fspath(base_path), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(os.fspath(out_path), safe_serialization=True)
    return os.fspath(out_path)


@functools.lru_cache(maxsize=8)
def _peft_model(base_path: str, adapter_path: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, attn_implementation="eager")
    return PeftModel.from_pretrained(base, adapter_path).eval()


def peft_greedy(base_path, adapter_path, prompt_ids, max_new_tokens: int) -> list[int]:
    """HF + PEFT float32 greedy continuation (new tokens only), ignoring EOS."""
    model = _peft_model(os.fspath(base_path), os.fspath(adapter_path))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=1,
        )
    return out[0, len(prompt_ids) :].tolist()

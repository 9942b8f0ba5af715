"""Tiny random Hugging Face checkpoints (model + real tokenizer) and transformers reference outputs.

TEST-ONLY: imports torch. Other tests use it as ``from tiny_models import make_tiny_checkpoint``.

A checkpoint is deterministic for a given (arch, overrides, seed): weights come from a seeded torch
generator, the tokenizer from BPE training on fixed text. Weights are scaled up from HF's default
(std 0.1 instead of 0.02, norms and biases perturbed away from 1 and 0) so that logits are O(1) and a
wrong RoPE, mask or bias shows up far above float32 rounding.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 512
BOS, EOS = "<s>", "</s>"  # ids 0 and 1

_CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

_BASE = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)

# name -> (arch, config overrides): the variants the parity tests cover.
VARIANTS = {
    "llama_gqa": ("llama", {}),
    "llama_mha_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),  # SmolLM2-like
    "llama3_rope": (
        "llama",
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500000.0,
        ),
    ),
    "llama_linear_rope": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral_swa": ("mistral", dict(sliding_window=8)),
    # Qwen2: qkv bias always; sliding window on layer 1 only (max_window_layers=1).
    "qwen2_bias_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Qwen3: q/k norm, and head_dim * heads != hidden_size as in the real Qwen3 models.
    "qwen3_qknorm": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
}

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TRAINING_TEXT = """
The quick brown fox jumps over the lazy dog. A serving engine batches requests from many users and
keeps their attention keys and values in pages of a shared cache. When a request finishes, its pages
return to the pool and another request takes them. Hello world! How are you today? I am fine, thank
you, and you? The weather is nice and the sun is shining over the hills and the river. Once upon a
time there was a little model that wanted to answer every question quickly and correctly. It learned
numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 and 2024, punctuation like commas, colons: semicolons; and
quotes "like these", and words such as apple, banana, cherry, orange, water, mountain, computer,
language, system, user, assistant, question, answer, token, sequence, prefill, decode, schedule.
Python and JAX compile programs for accelerators; XLA fuses operations and the kernels run fast.
"""


def make_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly ``vocab_size`` tokens (ids 0, 1 = <s>, </s>) and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    # Like Llama's tokenizer: encode() prepends <s>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0), (EOS, 1)]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=_CHAT_TEMPLATE, clean_up_tokenization_spaces=False
    )


def make_tiny_checkpoint(path, arch: str = "llama", *, seed: int = 0, max_shard_size=None, **config_overrides):
    """Write a tiny random ``arch`` model (safetensors) plus tokenizer to ``path``; returns ``path``.

    ``arch`` is a model type ("llama", "mistral", "qwen2", "qwen3") or a name from ``VARIANTS``.
    ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint with an index.
    """
    if arch in VARIANTS:
        arch, variant_overrides = VARIANTS[arch]
        config_overrides = {**variant_overrides, **config_overrides}
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch={arch!r}; use one of {sorted(_CONFIG_CLASSES)} or {sorted(VARIANTS)}")
    config = _CONFIG_CLASSES[arch](**{**_BASE, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    make_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(path, ids) -> "np.ndarray":
    """transformers' float32 logits [len(ids), vocab] for one sequence, as a numpy array."""
    with torch.no_grad():
        out = _hf_model(os.fspath(path))(torch.tensor([list(ids)]))
    return out.logits[0].float().numpy()


def hf_greedy(path, prompt_ids, max_new_tokens: int, *, ignore_eos: bool = False) -> list[int]:
    """transformers' float32 greedy continuation (new tokens only) of ``prompt_ids``."""
    model = _hf_model(os.fspath(path))
    kwargs = dict(min_new_tokens=max_new_tokens) if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


# A Qwen3-like template: the reply may open <think> itself; enable_thinking=false closes an empty block in the
# prompt (reasoning over), open_think=true leaves one open (a DeepSeek-R1-like prompt).
_THINK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if open_think %}<think>\n{% endif %}{% endif %}"
)


def make_think_checkpoint(path, *, seed: int = 0):
    """A tiny llama whose tokenizer holds <think> and </think> as single, non-special tokens (the last two ids of
    the model's vocabulary) and a template with Qwen3's enable_thinking switch; returns ``path``."""
    from tokenizers import AddedToken

    make_tiny_checkpoint(path, "llama", seed=seed, vocab_size=VOCAB_SIZE + 2)
    tok = make_tokenizer(VOCAB_SIZE)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = _THINK_TEMPLATE
    assert len(tok) == VOCAB_SIZE + 2
    tok.save_pretrained(path)
    return path


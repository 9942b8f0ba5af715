"""A GGUF file's metadata, turned into a Hugging Face config.json-style dict.

llama.cpp stores the model hyper-parameters as ``{arch}.*`` keys (``llama.block_count``, ...). The rest
of jaxserve reads HF field names (``TextModelConfig.from_hf_config``), so this module is the one place
that knows both spellings.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import gguf
import numpy as np

# GGUF architecture -> (HF model_type, HF class name). Mistral files say "llama": llama.cpp runs them
# as llama, and so do we (the two differ only by a sliding window llama.cpp ignores too).
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# A function that returns the value of a metadata key, or the default when the file lacks it.
Lookup = Callable[[str, Any], Any]


def build_hf_config(
    architecture: str,
    field: Lookup,
    tensor_names: set[str],
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    """The config.json-style dict for a GGUF file.

    ``field(key, default)`` reads metadata; ``tensor_names`` tells which optional tensors exist (the
    output head, biases); ``rope_freqs`` is the ``rope_freqs.weight`` tensor when the file has one
    (llama.cpp's way of storing Llama-3 RoPE scaling).
    """
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {architecture!r} (general.architecture) is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    model_type, class_name = SUPPORTED_GGUF_ARCHITECTURES[architecture]

    def arch_key(template: str) -> str:
        return template.format(arch=architecture)

    def required(template: str) -> Any:
        key = arch_key(template)
        value = field(key, None)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {key!r}, which a {architecture} model needs")
        return value

    K = gguf.Keys
    hidden = int(required(K.LLM.EMBEDDING_LENGTH))
    num_heads = _one_per_model(arch_key(K.Attention.HEAD_COUNT), required(K.Attention.HEAD_COUNT))
    num_kv = _one_per_model(
        arch_key(K.Attention.HEAD_COUNT_KV), field(arch_key(K.Attention.HEAD_COUNT_KV), num_heads)
    )
    head_dim = int(field(arch_key(K.Attention.KEY_LENGTH), hidden // num_heads))
    rotary_dim = field(arch_key(K.Rope.DIMENSION_COUNT), head_dim)
    if rotary_dim != head_dim:
        raise ValueError(
            f"{arch_key(K.Rope.DIMENSION_COUNT)}={rotary_dim} differs from head_dim={head_dim}; "
            "partial rotary embeddings are not supported for this architecture"
        )
    rope_theta = _decimal(field(arch_key(K.Rope.FREQ_BASE), 10000.0))
    vocab_size = field(arch_key(K.LLM.VOCAB_SIZE), None)
    if vocab_size is None:  # older files: the vocabulary itself says (read only then: 100k+ strings)
        tokens = field(K.Tokenizer.LIST, None)
        vocab_size = len(tokens) if tokens else None

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [class_name],
        "hidden_size": hidden,
        "intermediate_size": int(required(K.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(required(K.LLM.BLOCK_COUNT)),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _decimal(required(K.Attention.LAYERNORM_RMS_EPS)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(field(arch_key(K.LLM.CONTEXT_LENGTH), 2048)),
        "vocab_size": vocab_size,
        # llama.cpp's converter writes no output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensor_names),
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    if vocab_size is None:
        raise ValueError(
            f"GGUF metadata has neither {arch_key(K.LLM.VOCAB_SIZE)!r} nor {K.Tokenizer.LIST!r}; "
            "cannot tell the vocabulary size"
        )
    bos = field(K.Tokenizer.BOS_ID, None)
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos_ids = _eos_ids(field)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    rope_scaling = _rope_scaling(arch_key, field, rope_freqs, rope_theta, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _decimal(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.9999997e-06),
    so configs read from GGUF and from config.json compare equal."""
    return float(str(np.float32(value)))


def _one_per_model(key: str, value: Any) -> int:
    """Head counts may be stored per layer; we support only models where every layer agrees."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"{key} differs between layers ({sorted(set(value))}); only uniform layers are supported")
        value = value[0]
    return int(value)


def _eos_ids(field: Lookup) -> list[int]:
    """End-of-sequence ids: eos plus the end-of-turn/end-of-message ids chat models stop on
    (Llama 3 instruct ends a turn with <|eot_id|>, not with eos)."""
    K = gguf.Keys.Tokenizer
    ids: list[int] = []
    for key in (K.EOS_ID, K.EOT_ID, K.EOM_ID):
        value = field(key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _rope_scaling(
    arch_key: Callable[[str], str],
    field: Lookup,
    rope_freqs: np.ndarray | None,
    rope_theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    """HF's rope_scaling dict from GGUF's ``rope.scaling.*`` keys or its ``rope_freqs`` tensor."""
    K = gguf.Keys.Rope
    if rope_freqs is not None:
        return _llama3_scaling_from_freqs(rope_freqs, rope_theta, head_dim)
    kind = field(arch_key(K.SCALING_TYPE), None)
    factor = field(arch_key(K.SCALING_FACTOR), None)
    if kind is None and factor is None:
        # Old files spell linear scaling as one key.
        linear = field(arch_key("{arch}.rope.scale_linear"), None)
        if linear is None or float(linear) == 1.0:
            return None
        kind, factor = "linear", linear
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _decimal(factor if factor is not None else 1.0)}
    original = field(arch_key(K.SCALING_ORIG_CTX_LEN), None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key, hf_name in ((K.SCALING_YARN_BETA_FAST, "beta_fast"), (K.SCALING_YARN_BETA_SLOW, "beta_slow")):
        value = field(arch_key(key), None)
        if value is not None:
            scaling[hf_name] = _decimal(value)
    return scaling


# Llama 3.1/3.2/3.3 all use these; only the factor (8 or 32) differs between releases.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling_from_freqs(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's per-frequency divisors.

    The divisors are a function of four numbers; the file keeps only the result. We take the largest
    divisor as the factor, assume Meta's published low/high factors and original context, and check
    that they reproduce every divisor, so a file made differently fails loudly instead of running with
    the wrong positions.
    """
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {freqs.shape[0]} entries; expected head_dim/2 = {head_dim // 2}")
    scaling = {"rope_type": "llama3", "factor": _decimal(freqs.max()), **_LLAMA3_DEFAULTS}
    expected = _llama3_divisors(scaling, rope_theta, head_dim)
    if not np.allclose(expected, freqs, rtol=1e-3, atol=1e-4):
        raise ValueError(
            "rope_freqs.weight does not match Llama-3 RoPE scaling with factor="
            f"{scaling['factor']}, low_freq_factor=1, high_freq_factor=4, original context 8192; "
            "load the model's Hugging Face directory instead, whose config.json states its rope_scaling"
        )
    return scaling


def _llama3_divisors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """By how much Llama-3 scaling divides each RoPE frequency (1 = unchanged)."""
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    # Between the two wavelength bounds the scaled frequency blends linearly from inv/factor to inv.
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)

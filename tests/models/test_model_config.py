"""TextModelConfig.from_hf_config reads transformers 4 and 5 style dicts alike."""

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from jaxserve.models.config import TextModelConfig

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, head_dim=16)


def test_transformers5_dict_and_old_style_dict_agree():
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    new = LlamaConfig(**SMALL, rope_scaling=llama3, rope_theta=5e5, max_position_embeddings=128).to_dict()
    assert "rope_parameters" in new  # transformers 5 form
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=5e5, rope_scaling={**llama3, "type": "llama3"})
    old["rope_scaling"].pop("rope_type")
    a, b = TextModelConfig.from_hf_config(new), TextModelConfig.from_hf_config(old)
    assert a == b and hash(a) == hash(b)
    assert a.rope_theta == 5e5 and a.rope_type == "llama3" and a.rope_scaling_dict()["factor"] == 8.0
    assert a.head_dim == 16 and a.num_key_value_heads == 4 and not a.attention_bias


def test_default_rope_is_none():
    cfg = TextModelConfig.from_hf_config(MistralConfig(**SMALL, rope_theta=1e6).to_dict())
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6 and cfg.rope_type == "default"


def test_qwen_switches():
    q2 = TextModelConfig.from_hf_config(Qwen2Config(**SMALL).to_dict())
    assert q2.attention_bias and not q2.o_proj_bias and q2.sliding_window is None
    q2_swa = TextModelConfig.from_hf_config(
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2).to_dict()
    )
    assert [q2_swa.layer_sliding_window(i) for i in range(3)] == [None, None, 16]
    q3 = TextModelConfig.from_hf_config(Qwen3Config(**{**SMALL, "head_dim": 32}).to_dict())
    assert q3.qk_norm and q3.head_dim == 32 and not q3.attention_bias


def test_mistral_window_applies_to_every_layer():
    cfg = TextModelConfig.from_hf_config(MistralConfig(**SMALL, sliding_window=32).to_dict())
    assert [cfg.layer_sliding_window(i) for i in range(3)] == [32, 32, 32]


def test_errors_name_what_is_supported():
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"):
        TextModelConfig.from_hf_config({**SMALL, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        TextModelConfig.from_hf_config({**SMALL, "model_type": "llama", "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(ValueError, match="missing the required field 'vocab_size'"):
        TextModelConfig.from_hf_config({**SMALL, "model_type": "llama", "vocab_size": None})


def test_architectures_fallback_and_eos_list():
    d = {**SMALL, "architectures": ["Qwen2ForCausalLM"], "eos_token_id": [5, 6]}
    cfg = TextModelConfig.from_hf_config(d)
    assert cfg.architecture == "qwen2" and cfg.eos_token_ids == (5, 6)

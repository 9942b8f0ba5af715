"""A tiny GGUF file with a tokenizer, written from a tiny HF checkpoint (tests/tiny_models.py).

The tensors are the HF checkpoint's, in F32 (so the GGUF model computes exactly what the HF one does),
with Q and K rows permuted as llama.cpp's converter does; the tokenizer is a SentencePiece vocabulary
(bytes, letters, a few pairs) of the checkpoint's vocabulary size, so the file loads with its own tokenizer.
"""

from __future__ import annotations

import dataclasses
import itertools
import string
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from jaxserve.models.loader.hf import read_hf_config

_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}  # fmt: skip
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<s>", "</s>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]  # ids as the HF tokenizer's
    types = [CONTROL, CONTROL, UNKNOWN] + [BYTE] * 256
    letters = string.ascii_lowercase
    pieces = ["▁", *letters, *(f"▁{c}" for c in letters), *("".join(p) for p in itertools.product(letters, repeat=2))]
    pieces = pieces[: size - len(tokens)]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [NORMAL] * len(pieces)


def _block_type(gguf_name: str):
    """The block type a quantized tiny file stores a 2-D weight in: the three that stay quantized, all used."""
    T = gguf.GGMLQuantizationType
    if gguf_name in ("token_embd.weight", "output.weight"):
        return T.Q8_0
    return T.Q4_0 if ".attn_output." in gguf_name else T.Q4_1


def write_gguf_from_hf(hf_dir, path, quantized: bool = False) -> Path:
    """Write ``hf_dir`` (a llama checkpoint from make_tiny_checkpoint) as a GGUF file at ``path``. ``quantized``:
    the projections in Q4_1 (o_proj in Q4_0) and the embedding and head in Q8_0, as llama.cpp's quantizer writes
    them, instead of F32."""
    hf_dir, path = Path(hf_dir), Path(path)
    c = read_hf_config(hf_dir)
    assert c.architecture == "llama" and c.rope_scaling is None, "plain llama checkpoints only"
    cfg = dataclasses.asdict(c)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, scores, types = _vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for name, array in load_file(hf_dir / "model.safetensors").items():
        if ".q_proj." in name:
            array = _permute(array, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            array = _permute(array, cfg["num_key_value_heads"])
        array = np.ascontiguousarray(array, dtype=np.float32)
        if quantized and array.ndim == 2:
            qtype = _block_type(_gguf_name(name))
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""GGUF reading on tiny files written here with gguf.GGUFWriter: renaming, Q/K un-permutation, config."""

import numpy as np
import pytest

import gguf
from jaxserve.models.config import TextModelConfig
from jaxserve.models.loader.gguf import read_gguf, undo_rope_permutation

H, F, L, V = 32, 48, 2, 64  # hidden, ffn, layers, vocab
NH, NKV, HD = 4, 2, 8  # query heads, kv heads, head_dim


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K rows: each head's two halves become interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_hf_tensors(rng, *, tied=True, qkv_bias=False, qk_norm=False):
    """A small llama-style HF state dict (float32)."""
    t = {"model.embed_tokens.weight": rng.standard_normal((V, H)), "model.norm.weight": rng.standard_normal(H)}
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = rng.standard_normal(H)
        t[p + "post_attention_layernorm.weight"] = rng.standard_normal(H)
        t[p + "self_attn.q_proj.weight"] = rng.standard_normal((NH * HD, H))
        t[p + "self_attn.k_proj.weight"] = rng.standard_normal((NKV * HD, H))
        t[p + "self_attn.v_proj.weight"] = rng.standard_normal((NKV * HD, H))
        t[p + "self_attn.o_proj.weight"] = rng.standard_normal((H, NH * HD))
        t[p + "mlp.gate_proj.weight"] = rng.standard_normal((F, H))
        t[p + "mlp.up_proj.weight"] = rng.standard_normal((F, H))
        t[p + "mlp.down_proj.weight"] = rng.standard_normal((H, F))
        if qkv_bias:
            t[p + "self_attn.q_proj.bias"] = rng.standard_normal(NH * HD)
            t[p + "self_attn.k_proj.bias"] = rng.standard_normal(NKV * HD)
            t[p + "self_attn.v_proj.bias"] = rng.standard_normal(NKV * HD)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = rng.standard_normal(HD)
            t[p + "self_attn.k_norm.weight"] = rng.standard_normal(HD)
    return {k: v.astype(np.float32) for k, v in t.items()}


_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def write_tiny_gguf(path, arch, hf_tensors, *, permute_qk, dtype=np.float32, extra=None, rope_freqs=None, qtype=None):
    """``qtype(hf_name, array)``, if given, names a gguf quantization type for a tensor (None: store as ``dtype``)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_dimension_count(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra:
        extra(w)
    for name, array in hf_tensors.items():
        if permute_qk and ".q_proj." in name:
            array = llama_cpp_permute(array, NH)
        elif permute_qk and ".k_proj." in name:
            array = llama_cpp_permute(array, NKV)
        quant = qtype(name, array) if qtype else None
        if quant is not None:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:  # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the file type.
            w.add_tensor(gguf_name(name), array.astype(dtype) if array.ndim == 2 else array)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_tensors(checkpoint, expected):
    got = dict(checkpoint.tensors())
    assert sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_llama_tied_roundtrip_undoes_qk_permutation(tmp_path):
    hf = random_hf_tensors(np.random.default_rng(0))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", hf, permute_qk=True)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    assert ckpt.hf_config == {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256, "vocab_size": V,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    assert_same_tensors(ckpt, hf)
    config = TextModelConfig.from_hf_config(ckpt.hf_config)
    assert (config.architecture, config.head_dim, config.tie_word_embeddings) == ("llama", HD, True)


def test_llama_untied_f16_with_biases(tmp_path):
    # F16 storage rounds the weights; compare against the rounded originals, which must come back exactly.
    hf = random_hf_tensors(np.random.default_rng(1), tied=False, qkv_bias=True)
    hf = {k: (v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v) for k, v in hf.items()}

    def eot(w):
        w.add_eot_token_id(5)

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", hf, permute_qk=True, dtype=np.float16, extra=eot)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    assert ckpt.hf_config["tie_word_embeddings"] is False
    assert ckpt.hf_config["attention_bias"] is True
    assert ckpt.hf_config["eos_token_id"] == [2, 5]  # eos, then end-of-turn
    assert_same_tensors(ckpt, hf)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_keeps_hf_row_order(tmp_path, arch):
    hf = random_hf_tensors(np.random.default_rng(2), qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, hf, permute_qk=False)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    assert ckpt.hf_config["model_type"] == arch
    assert_same_tensors(ckpt, hf)
    config = TextModelConfig.from_hf_config(ckpt.hf_config)
    assert config.qk_norm == (arch == "qwen3")


def test_llama3_rope_scaling_recovered():
    from jaxserve.models.loader.gguf_config import _llama3_divisors, build_hf_config

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    meta = {"llama.embedding_length": 2048, "llama.attention.head_count": 16, "llama.feed_forward_length": 64,
            "llama.block_count": 1, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 500000.0,
            "llama.vocab_size": 10}  # fmt: skip
    freqs = _llama3_divisors(scaling, 500000.0, 128).astype(np.float32)
    assert freqs.min() == 1.0 and freqs.max() == 32.0 and ((freqs > 1) & (freqs < 32)).any()  # all 3 zones
    config = build_hf_config("llama", lambda k, d: meta.get(k, d), {"token_embd.weight"}, freqs)
    assert config["rope_scaling"] == scaling
    with pytest.raises(ValueError, match="rope_freqs.weight does not match"):
        build_hf_config("llama", lambda k, d: meta.get(k, d), set(), freqs ** 0.5)


def test_rope_freqs_tensor_is_not_yielded(tmp_path):
    hf = random_hf_tensors(np.random.default_rng(4))
    freqs = np.ones(HD // 2, np.float32)  # all ones: llama3 scaling with factor 1 (a no-op, but valid)
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", hf, permute_qk=True, rope_freqs=freqs)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    assert ckpt.hf_config["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in dict(ckpt.tensors())


def test_unsupported_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'phi3'.*supported: llama, qwen2, qwen3"):
        read_gguf(tmp_path / "x.gguf")


def test_unknown_tensor_is_named(tmp_path):
    hf = random_hf_tensors(np.random.default_rng(5))
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", hf, permute_qk=True)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    ckpt._hf_name("blk.0.attn_q.weight")  # known
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        ckpt._hf_name("blk.0.ffn_gate_exps.weight")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def _rope_rotate_half(x, pos, theta=10000.0):
    """HF's RoPE on one head vector: dim i pairs with dim i + d/2."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rope_interleaved(x, pos, theta=10000.0):
    """llama.cpp's RoPE for llama: dims 2i and 2i+1 form a pair."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def test_permutation_is_what_llama_cpp_rope_needs():
    """Independent of transformers: attention scores from HF weights with HF's RoPE equal the scores
    from llama.cpp-permuted weights with llama.cpp's RoPE; and un-permuting gives the HF weights back."""
    rng = np.random.default_rng(6)
    wq, wk = rng.standard_normal((NH * HD, H)), rng.standard_normal((NH * HD, H))
    x1, x2 = rng.standard_normal(H), rng.standard_normal(H)
    heads = lambda v: v.reshape(NH, HD)  # noqa: E731
    hf_scores = (_rope_rotate_half(heads(wq @ x1), 7) * _rope_rotate_half(heads(wk @ x2), 3)).sum(-1)
    pq, pk = llama_cpp_permute(wq, NH), llama_cpp_permute(wk, NH)
    cpp_scores = (_rope_interleaved(heads(pq @ x1), 7) * _rope_interleaved(heads(pk @ x2), 3)).sum(-1)
    np.testing.assert_allclose(cpp_scores, hf_scores, rtol=1e-10)
    np.testing.assert_array_equal(undo_rope_permutation(pq, NH), wq)
    bias = rng.standard_normal(NKV * HD)
    np.testing.assert_array_equal(undo_rope_permutation(llama_cpp_permute(bias, NKV), NKV), bias)

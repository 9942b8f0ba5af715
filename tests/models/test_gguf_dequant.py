"""Dequantizing GGUF tensors on the device equals gguf.quants on the host, bit for bit on the CPU."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.loader.gguf_dequant import BLOCK_DECODERS, to_device, undo_rope_permutation

T = gguf.GGMLQuantizationType

# Where each block keeps its float16 scales (the other bytes may be anything).
_SCALE_BYTES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q6_K: [208]}


def random_tensor(rng, tensor_type, rows, cols):
    """Stored bytes (uint8 [n_bytes]) of a [rows, cols] tensor: random blocks with finite scales."""
    if tensor_type == T.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32).reshape(-1).view(np.uint8)
    if tensor_type == T.F16:
        return rng.standard_normal((rows, cols)).astype(np.float16).reshape(-1).view(np.uint8)
    if tensor_type == T.BF16:
        return rng.standard_normal((rows, cols)).astype(jnp.bfloat16).reshape(-1).view(np.uint8)
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for at in _SCALE_BYTES[tensor_type]:
        blocks[:, at : at + 2] = rng.standard_normal((len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def test_every_device_type_is_covered():
    assert set(BLOCK_DECODERS) <= set(_SCALE_BYTES)


@pytest.mark.parametrize("tensor_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F32, T.F16, T.BF16, T.Q6_K])
def test_matches_gguf_quants(tensor_type):
    """Q6_K has no device decoder: it takes the host fallback, which must give the same shape and layout."""
    rows, cols = 6, 512  # two k-quant super-blocks, or 16 small blocks, per row
    raw = random_tensor(np.random.default_rng(int(tensor_type)), tensor_type, rows, cols)
    expected = gguf.quants.dequantize(raw, tensor_type).reshape(rows, cols).astype(np.float32)
    got = to_device(raw, tensor_type, (rows, cols), rope_heads=None, transpose=False, dtype=jnp.float32, sharding=None)
    assert got.shape == (rows, cols) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpermute_transpose_and_cast_in_one_program(dtype):
    heads, head_dim, cols = 3, 8, 64
    raw = random_tensor(np.random.default_rng(7), T.Q4_1, heads * head_dim, cols)
    stored = gguf.quants.dequantize(raw, T.Q4_1).reshape(heads * head_dim, cols)
    expected = undo_rope_permutation(stored, heads).T.astype(dtype)  # [in, out]
    got = to_device(raw, T.Q4_1, stored.shape, rope_heads=heads, transpose=True, dtype=dtype, sharding=None)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_llama_loads_like_its_host_tensors(tmp_path, tp):
    """The model loader's device path (packed tensors) builds the same parameters as the host path,
    placed by the mesh's shardings when tensor-parallel (each device decodes and keeps its shard)."""
    from flax import nnx
    from test_gguf_tiny import random_hf_tensors, write_tiny_gguf

    from jaxserve import sharding
    from jaxserve.model_loader import load_model
    from jaxserve.models.config import TextModelConfig
    from jaxserve.models.loader.gguf import read_gguf
    from jaxserve.models.loader.weights import load_from_hf_tensors
    from jaxserve.pallas_kernels.attention import paged_attention

    hf = random_hf_tensors(np.random.default_rng(3))
    path = tmp_path / "tiny.gguf"

    def qtype(name, array):  # as llama.cpp's Q4_1 files: a Q8_0 embedding, Q4_1 where rows split into blocks
        if name == "model.embed_tokens.weight":
            return T.Q8_0
        return T.Q4_1 if array.ndim == 2 and array.shape[1] % 32 == 0 else None  # the 48-wide down_proj: F32

    write_tiny_gguf(path, "llama", hf, permute_qk=True, qtype=qtype)
    mesh = sharding.replica_meshes(sharding.make_mesh(tp, 1))[0]
    model, cfg = load_model(
        str(path), "gguf", dtype=jnp.float32, attention_fn=paged_attention, shardings_fn=sharding.shardings_fn(mesh)
    )
    ckpt = read_gguf(path)
    assert {t.tensor_type for t in ckpt._file.tensors} >= {T.Q8_0, T.Q4_1, T.F32}
    reference = load_from_hf_tensors(
        TextModelConfig.from_hf_config(ckpt.hf_config), ckpt.tensors(), dtype=jnp.float32,
        attention_fn=paged_attention,
    )  # fmt: skip
    got, want = nnx.to_flat_state(nnx.state(model)), dict(nnx.to_flat_state(nnx.state(reference)))
    for path_, var in got:
        got_value, want_value = np.asarray(var.get_value()), np.asarray(want[path_].get_value())
        np.testing.assert_array_equal(got_value, want_value, err_msg=str(path_))
    qkv_kernel = model.model.layers[0].self_attn.qkv_proj.kernel.get_value()  # [D, K, G+2, Dh]: K split over "model"
    assert len(qkv_kernel.sharding.device_set) == tp
    d, k, g2, dh = qkv_kernel.shape
    assert qkv_kernel.addressable_shards[0].data.shape == (d, k // tp, g2, dh)


@pytest.mark.slow
def test_default_model_device_path_equals_host_path():
    from jaxserve.models.loader.default_model import default_model_path
    from jaxserve.models.loader.gguf import read_gguf

    try:
        ckpt = read_gguf(default_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    seen = set()
    for (name, packed), (_, host) in zip(ckpt.packed_tensors(), ckpt.tensors()):
        np.testing.assert_array_equal(np.asarray(packed.to_param(transpose=False, dtype=jnp.float32)), host, name)
        seen.add(packed.info.tensor_type)
    assert seen == {T.Q4_1, T.Q8_0, T.F32}

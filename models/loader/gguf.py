"""Reading GGUF checkpoints (llama.cpp's file format) without torch.

``read_gguf(path)`` gives a config.json-style dict and the weights as float32 numpy arrays under their
Hugging Face names, so the GGUF path meets the safetensors path at ``TextModelConfig.from_hf_config``
and the HF-name weight loader. Parsing and dequantization are the ``gguf`` package's; this file only
renames tensors and undoes llama.cpp's row reordering of Q and K.
"""

from __future__ import annotations

import functools
import os
import re
from functools import cached_property
from typing import Any, Iterator

import gguf
import numpy as np

from jaxserve.models.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, build_hf_config

# Whole-model tensors: GGUF name -> HF name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Per-layer tensors (blk.N.<key>.<weight|bias>): GGUF key -> HF module path under model.layers.N.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Tensors that are not weights of the HF model: their content went into hf_config instead.
_FOLDED_INTO_CONFIG = {"rope_freqs.weight"}

# llama.cpp's converter reorders Q/K rows only for these (it reads HF's rotate-half RoPE layout and
# writes the interleaved-pairs layout its own RoPE kernel expects); Qwen files keep HF's order.
_PERMUTED_QK_ARCHITECTURES = {"llama"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def read_gguf(path: str | os.PathLike) -> "GGUFCheckpoint":
    """Open a GGUF file (memory-mapped: nothing is dequantized until ``tensors()`` runs)."""
    return GGUFCheckpoint(os.fspath(path))


def open_gguf_reader(path: str | os.PathLike) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` for ``path``, shared by the weight and tokenizer loaders.

    The reader parses every metadata array up front (a large vocabulary takes seconds), and serving a
    file reads it twice (weights, then tokenizer), so the last few readers are kept; a changed file
    (new size or mtime) is read again.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    stat = os.stat(path)
    return _cached_reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises bare ValueErrors about magic numbers and offsets
        raise ValueError(f"{path!r} is not a readable GGUF file: {exc}") from exc


class GGUFCheckpoint:
    """One GGUF file seen as a Hugging Face checkpoint: ``hf_config`` and ``tensors()``."""

    def __init__(self, path: str):
        self.path = path
        self._reader = open_gguf_reader(path)
        self.architecture: str = self.field("general.architecture", None) or ""
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path!r} holds a GGUF architecture {self.architecture!r} (general.architecture), "
                f"which is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

    def field(self, key: str, default: Any = None) -> Any:
        """The value of one metadata key (a str, number, bool or list), or ``default``."""
        f = self._reader.fields.get(key)
        return default if f is None else f.contents()

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """A config.json-style dict: ``model_type``, ``architectures`` and HF field names."""
        names = {t.name for t in self._reader.tensors}
        rope_freqs = None
        for t in self._reader.tensors:
            if t.name == "rope_freqs.weight":
                rope_freqs = _dequantize(t)
        return build_hf_config(self.architecture, self.field, names, rope_freqs)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` one tensor at a time, in file order.

        Arrays use HF's layout (linear weights are [out, in]), are writable and are not views of the
        file, so a caller that converts and drops each one keeps one dequantized tensor alive at a time. There is no
        ``lm_head.weight`` when ``hf_config["tie_word_embeddings"]`` is true.
        """
        config = self.hf_config
        permute = self.architecture in _PERMUTED_QK_ARCHITECTURES
        for t in self._reader.tensors:
            if t.name in _FOLDED_INTO_CONFIG:
                continue
            hf_name = self._hf_name(t.name)
            array = _dequantize(t)
            if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                array = undo_rope_permutation(array, config["num_attention_heads"])
            elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                array = undo_rope_permutation(array, config["num_key_value_heads"])
            yield hf_name, array

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        match = _BLOCK_RE.match(name)
        if match and match.group(2) in _BLOCK_NAMES:
            layer, key, kind = match.groups()
            return f"model.layers.{layer}.{_BLOCK_NAMES[key]}.{kind}"
        raise ValueError(
            f"{self.path!r}: tensor {name!r} has no Hugging Face counterpart for a {self.architecture} model; "
            f"known per-layer tensors are blk.N.{{{','.join(_BLOCK_NAMES)}}}.weight/bias "
            "(mixture-of-experts and other extra tensors are not supported)"
        )


def _dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    """One tensor as a writable float32 array in numpy (row-major, HF) order."""
    array = gguf.quants.dequantize(t.data, t.tensor_type)
    # ggml lists dimensions fastest-first; numpy and HF list them slowest-first.
    expected = tuple(int(d) for d in reversed(t.shape.tolist()))
    array = array.reshape(expected)
    # F32 tensors come back as read-only views of the memory map; copy those so callers own them.
    return np.require(array, dtype=np.float32, requirements=["C", "W"])


def undo_rope_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Put llama.cpp's Q or K rows back in Hugging Face order.

    Within one head of d rows, HF's RoPE pairs row i with row i + d/2 (rotate-half), while
    llama.cpp's pairs rows 2i and 2i+1; so its converter stores HF row ``half*d/2 + i`` at row
    ``2*i + half``. Here each head's rows are read as (i, half) and written back as (half, i).
    Works for weights [heads*head_dim, in] and biases [heads*head_dim].
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot split {rows} Q/K rows into {num_heads} heads of pairs")
    pairs = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2)).reshape(w.shape)

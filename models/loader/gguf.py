"""Reading GGUF checkpoints (llama.cpp's file format) without torch.

``read_gguf(path)`` gives a config.json-style dict and the weights under their Hugging Face names, so
the GGUF path meets the safetensors path at ``TextModelConfig.from_hf_config`` and the HF-name weight
loader. The header is parsed by ``gguf_file`` (a quick single pass), the weights are dequantized on the
device by ``gguf_dequant`` when loading a model, and by ``gguf.quants`` on the host for ``tensors()``;
this file renames tensors and knows which rows llama.cpp reordered.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from functools import cached_property
from typing import Any, Iterator

import gguf
import jax
import numpy as np

from jaxserve.models import quantized
from jaxserve.models.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES, build_hf_config
from jaxserve.models.loader.gguf_dequant import to_device, undo_rope_permutation
from jaxserve.models.loader.gguf_file import GGUFFile, TensorInfo

__all__ = ["GGUFCheckpoint", "GGUFTensor", "open_gguf", "read_gguf", "undo_rope_permutation"]

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
    """Open a GGUF file (memory-mapped: no weight is read until ``tensors()`` or ``packed_tensors()`` runs)."""
    return GGUFCheckpoint(os.fspath(path))


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed header of ``path``, shared by the weight and tokenizer loaders (serving a file reads
    it twice: weights, then tokenizer); a changed file (new size or mtime) is read again."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    stat = os.stat(path)
    return _cached_file(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_file(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One stored tensor, not yet read: ``shape`` is its HF shape; ``to_param`` and ``to_numpy`` decode it."""

    file: GGUFFile
    info: TensorInfo
    rope_heads: int | None  # llama.cpp reordered these rows for this many heads (llama Q/K), else None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def to_param(self, *, transpose: bool, dtype: Any, sharding: Any = None) -> jax.Array:
        """The parameter, decoded on the device in one pass (``transpose``: HF [out, in] -> [in, out])."""
        return to_device(
            self.file.raw(self.info), self.info.tensor_type, self.info.shape,
            rope_heads=self.rope_heads, transpose=transpose, dtype=dtype, sharding=sharding,
        )  # fmt: skip

    def to_numpy(self) -> np.ndarray:
        """A writable float32 array in HF order and layout, decoded on the host by ``gguf.quants``."""
        array = _dequantize(self.file, self.info)
        return undo_rope_permutation(array, self.rope_heads) if self.rope_heads else array


class _DecodedBlocks:
    """One block-quantized tensor decoded on the host once for its three GGUFQuantParts (codes, scales, offsets):
    the first part asked for decodes all three; the arrays are let go once each part has been taken."""

    def __init__(self, file: GGUFFile, info: TensorInfo):
        self.file, self.info = file, info
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._taken: set[int] = set()

    def take(self, part: int) -> np.ndarray:
        if self._arrays is None:
            self._arrays = quantized.decode_blocks(self.file.raw(self.info), self.info.tensor_type.name, self.info.shape)
        value = self._arrays[part]
        self._taken.add(part)
        if len(self._taken) == len(self._arrays):
            self._arrays, self._taken = None, set()
        return value


@dataclasses.dataclass(frozen=True)
class GGUFQuantPart:
    """One part of a block-quantized tensor kept quantized (models/quantized.py): its int8 codes ("weight") or
    its per-block scales or offsets ("weight_scale", "weight_offset"), decoded on the host, in HF order."""

    blocks: _DecodedBlocks  # shared by the tensor's three parts
    rope_heads: int | None
    part: int  # 0 codes, 1 scales, 2 offsets

    @property
    def shape(self) -> tuple[int, ...]:
        n, k = self.blocks.info.shape
        return (n, k) if self.part == 0 else (n, k // quantized.BLOCK)

    def to_param(self, *, transpose: bool, dtype: Any, sharding: Any = None) -> jax.Array:
        value = self.blocks.take(self.part)
        if self.rope_heads:
            value = undo_rope_permutation(value, self.rope_heads)
        value = np.ascontiguousarray(value.T if transpose else value, dtype=dtype)
        return jax.device_put(value, sharding) if sharding is not None else jax.device_put(value)


def _keeps_quantized(hf_name: str) -> bool:
    """The tensors a quantized model holds as codes: every projection's and the embedding's (or untied head's)."""
    return hf_name.endswith("proj.weight") or hf_name in ("model.embed_tokens.weight", "lm_head.weight")


class GGUFCheckpoint:
    """One GGUF file seen as a Hugging Face checkpoint: ``hf_config`` and its tensors."""

    def __init__(self, path: str):
        self.path = path
        self._file = open_gguf(path)
        self.architecture: str = self.field("general.architecture", None) or ""
        if self.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path!r} holds a GGUF architecture {self.architecture!r} (general.architecture), "
                f"which is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

    def field(self, key: str, default: Any = None) -> Any:
        """The value of one metadata key (a str, number, bool or list), or ``default``."""
        return self._file.fields.get(key, default)

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """A config.json-style dict: ``model_type``, ``architectures`` and HF field names."""
        names = {t.name for t in self._file.tensors}
        rope_freqs = None
        for t in self._file.tensors:
            if t.name == "rope_freqs.weight":
                rope_freqs = _dequantize(self._file, t)
        return build_hf_config(self.architecture, self.field, names, rope_freqs)

    def unquantizable_types(self) -> set[str]:
        """The tensor types of this file's projections and embedding that cannot stay quantized
        (models/quantized.BLOCK_BYTES lists those that can): empty when the whole model can."""
        return {t.tensor_type.name for name, t in self._named() if _keeps_quantized(name)
                and t.tensor_type.name not in quantized.BLOCK_BYTES}  # fmt: skip

    def _named(self) -> Iterator[tuple[str, TensorInfo]]:
        for t in self._file.tensors:
            if t.name not in _FOLDED_INTO_CONFIG:
                yield self._hf_name(t.name), t

    def packed_tensors(self, quantized_weights: bool = False) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, GGUFTensor)`` in file order, reading nothing: the model loader decodes each
        on the device. There is no ``lm_head.weight`` when ``hf_config["tie_word_embeddings"]`` is true.
        ``quantized_weights``: the projections and the embedding come as three GGUFQuantParts each (``weight``,
        ``weight_scale``, ``weight_offset``); every one must be of a type in quantized.BLOCK_BYTES."""
        config = self.hf_config
        permute = self.architecture in _PERMUTED_QK_ARCHITECTURES
        for t in self._file.tensors:
            if t.name in _FOLDED_INTO_CONFIG:
                continue
            hf_name = self._hf_name(t.name)
            rope_heads = None
            if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                rope_heads = config["num_attention_heads"]
            elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                rope_heads = config["num_key_value_heads"]
            if quantized_weights and _keeps_quantized(hf_name):
                stem, blocks = hf_name[: -len("weight")], _DecodedBlocks(self._file, t)
                for part, suffix in enumerate(("weight", "weight_scale", "weight_offset")):
                    yield stem + suffix, GGUFQuantPart(blocks, rope_heads, part)
                continue
            yield hf_name, GGUFTensor(self._file, t, rope_heads)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, float32 array)`` one tensor at a time, in file order, decoded on the host.

        Arrays use HF's layout (linear weights are [out, in]), are writable and are not views of the
        file, so a caller that converts and drops each one keeps one dequantized tensor alive at a time.
        """
        for hf_name, tensor in self.packed_tensors():
            yield hf_name, tensor.to_numpy()

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


def _dequantize(file: GGUFFile, t: TensorInfo) -> np.ndarray:
    """One tensor as a writable float32 array in numpy (row-major, HF) order."""
    array = gguf.quants.dequantize(file.raw(t), t.tensor_type).reshape(t.shape)
    # F32 tensors come back as read-only views of the memory map; copy those so callers own them.
    return np.require(array, dtype=np.float32, requirements=["C", "W"])

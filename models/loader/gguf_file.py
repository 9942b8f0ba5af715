"""A GGUF file's header (metadata and tensor table) read in one quick pass, its tensor data memory-mapped.

``gguf.GGUFReader`` makes a numpy view for every piece of every metadata value: the 49k-token
vocabulary and 49k merges of the default model cost it ~1.8 s per open. Serving needs the values, not
the views, so this reader decodes each value straight into Python objects (lists of str for string
arrays, one ``np.frombuffer(...).tolist()`` for numeric arrays): ~0.1 s for the same file. The values
equal ``gguf.ReaderField.contents()`` (tests check that on every field), and the constants (value types,
quantization block sizes, ``gguf.Keys``) stay the ``gguf`` package's.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)

# Fixed-size metadata value types -> little-endian numpy dtype.
_V = gguf.GGUFValueType
_SCALAR_DTYPES = {
    _V.UINT8: np.dtype("<u1"), _V.INT8: np.dtype("<i1"), _V.UINT16: np.dtype("<u2"), _V.INT16: np.dtype("<i2"),
    _V.UINT32: np.dtype("<u4"), _V.INT32: np.dtype("<i4"), _V.FLOAT32: np.dtype("<f4"), _V.BOOL: np.dtype("?"),
    _V.UINT64: np.dtype("<u8"), _V.INT64: np.dtype("<i8"), _V.FLOAT64: np.dtype("<f8"),
}  # fmt: skip
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (slowest first): ggml's dimension list reversed
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


class GGUFFile:
    """``fields``: key -> value (str, int, float, bool, or a list of those); ``tensors``: the tensor
    table in file order; ``raw(t)``: a tensor's bytes as a read-only uint8 view of the memory map."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.fields, self.tensors = _parse(self._map)
        except (ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"{self.path!r} is not a readable GGUF file: {exc}") from exc
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The stored bytes of ``t`` (uint8 [n_bytes], a view: nothing is read until used)."""
        return self._bytes[t.offset : t.offset + t.n_bytes]


def _parse(buf: mmap.mmap) -> tuple[dict[str, Any], list[TensorInfo]]:
    if buf[:4] != _MAGIC:
        raise ValueError(f"the file starts with {bytes(buf[:4])!r}, not the GGUF magic {_MAGIC!r}")
    (version,) = _U32.unpack_from(buf, 4)
    if version not in _VERSIONS:
        hint = " (a big-endian file? only little-endian GGUF files are read)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version} is not supported{hint}; supported versions: {_VERSIONS}")
    n_tensors, n_fields = struct.unpack_from("<QQ", buf, 8)
    reader = _Reader(buf, 24)
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = reader.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        fields[key] = reader.value(reader.u32())

    table = []
    for _ in range(n_tensors):
        name = reader.string()
        n_dims = reader.u32()
        dims = struct.unpack_from(f"<{n_dims}Q", buf, reader.pos)
        reader.pos += 8 * n_dims
        tensor_type = gguf.GGMLQuantizationType(reader.u32())
        table.append((name, tensor_type, dims, reader.u64()))

    alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment={alignment!r} is not a power of two")
    data_start = -(-reader.pos // alignment) * alignment
    tensors, names = [], set()
    for name, tensor_type, dims, offset in table:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims, dtype=np.int64))
        if dims and dims[0] % block_size:
            raise ValueError(f"tensor {name!r}: row length {dims[0]} is not a multiple of {tensor_type.name}'s block")
        info = TensorInfo(
            name, tensor_type, tuple(reversed(dims)), data_start + offset, n_elements // block_size * type_size
        )
        if info.offset + info.n_bytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated download?)")
        tensors.append(info)
    return fields, tensors


class _Reader:
    """A cursor over the header that decodes values into Python objects."""

    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        start = self.pos
        self.pos += n
        return str(self.buf[start : self.pos], "utf-8")

    def value(self, raw_type: int) -> Any:
        kind = gguf.GGUFValueType(raw_type)
        if kind == _V.STRING:
            return self.string()
        if kind == _V.ARRAY:
            return self.array()
        dtype = _SCALAR_DTYPES[kind]
        value = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return value

    def array(self) -> list:
        kind = gguf.GGUFValueType(self.u32())
        count = self.u64()
        dtype = _SCALAR_DTYPES.get(kind)
        if dtype is not None:  # the common numeric case (scores, token types): one bulk read
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += dtype.itemsize * count
            return values
        if kind == _V.STRING:  # vocabularies and merges: length-prefixed, so walked one by one
            buf, pos, out = self.buf, self.pos, []
            unpack, append = _U64.unpack_from, out.append
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                append(str(buf[pos : pos + n], "utf-8"))
                pos += n
            self.pos = pos
            return out
        if kind == _V.ARRAY:  # nested arrays come back flattened, as gguf's contents() gives them
            return [v for _ in range(count) for v in self.array()]
        raise ValueError(f"unknown GGUF metadata value type {int(kind)}")

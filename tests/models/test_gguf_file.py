"""The quick GGUF header reader agrees with gguf.GGUFReader: every metadata value, the tensor table, the bytes."""

import gguf
import numpy as np
import pytest

from jaxserve.models.loader.gguf_file import GGUFFile

T = gguf.GGMLQuantizationType


def assert_same_as_gguf_reader(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, value in ref_fields.items():
        assert ours.fields[key] == value, key
        assert type(ours.fields[key]) is type(value), key  # bools stay bools, floats floats
        if isinstance(value, list):
            assert [type(v) for v in ours.fields[key]] == [type(v) for v in value], key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(reversed(theirs.shape.tolist())), mine.name
        assert (mine.offset, mine.n_bytes) == (theirs.data_offset, theirs.n_bytes), mine.name
        np.testing.assert_array_equal(ours.raw(mine), np.asarray(theirs.data).reshape(-1).view(np.uint8))
    return ours


def test_every_value_type_and_tensor_table(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 1e-5)  # not exact in float32: must come back as the float32 value, as gguf gives it
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ▁wörld 🤖")
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>", "中文"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_key_value("t.u8s", [1, 2, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("q8", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("q41", gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), T.Q4_1), raw_dtype=T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = assert_same_as_gguf_reader(path)
    assert ours.fields["t.nested"] == [1, 2, 3]  # flattened, as gguf's contents() gives nested arrays
    assert [t.shape for t in ours.tensors] == [(3, 5), (7,), (2, 64), (4, 32)]
    assert all(t.offset % 64 == 0 for t in ours.tensors)


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"bad.gguf.*not the GGUF magic"):
        GGUFFile(bad)


def test_truncated_file_is_named(tmp_path):
    path = tmp_path / "full.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", np.ones((64, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut.gguf.*'w' runs past the end of the file"):
        GGUFFile(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(path.read_bytes()[:30])
    with pytest.raises(ValueError, match="header.gguf"):
        GGUFFile(header_only)


@pytest.mark.slow
def test_default_model_file_matches_gguf_reader():
    from jaxserve.models.loader.default_model import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ours = assert_same_as_gguf_reader(path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152

"""`jaxserve convert` directories (orbax weights): bit-identical round trips from every source format, a
restore straight into TP shardings, a cast to another dtype, and a clear error for each way a checkpoint
can be missing, partial, edited or too new."""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import checkpoint
from flax import nnx

from jaxserve import sharding
from jaxserve.convert import convert
from jaxserve.model_loader import load_model, load_tokenizer, read_text_config, resolve_model_path
from jaxserve.models.loader.orbax_format import FORMAT_VERSION, METADATA_FILE, CheckpointError
from jaxserve.pallas_kernels.attention import get_attention_fn

ATTN = get_attention_fn("reference", "cpu")

# After a failed read, orbax's background thread may still post to its closed asyncio loop; the failure
# itself is what the error tests check.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@functools.lru_cache(maxsize=None)
def _source(kind: str, root: str) -> tuple[str, str]:
    """(model argument, load_format) of a tiny source of each kind."""
    if kind == "hf":
        return checkpoint("llama_gqa"), "auto"
    if kind == "gguf":
        from tiny_gguf import write_gguf_from_hf  # here: the GPU image may lack the gguf package

        return str(write_gguf_from_hf(checkpoint("llama_gqa"), os.path.join(root, "tiny.gguf"))), "auto"
    config_dir = os.path.join(root, "config_only")  # what a benchmark's dummy run starts from
    os.makedirs(config_dir, exist_ok=True)
    shutil.copyfile(os.path.join(checkpoint("llama_mha_tied"), "config.json"), os.path.join(config_dir, "config.json"))
    return config_dir, "dummy"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("orbax"))


@functools.lru_cache(maxsize=None)
def _converted(kind: str, root: str, dtype: str = "float32") -> str:
    model, load_format = _source(kind, root)
    out = os.path.join(root, f"{kind}-{dtype}")
    convert(model, out, dtype=dtype, load_format=load_format, seed=3)
    return out


def _weights(model: str, load_format: str = "auto", dtype=jnp.float32, shardings_fn=None, seed: int = 3):
    path, fmt = resolve_model_path(model, load_format)
    m, cfg = load_model(path, fmt, dtype=dtype, attention_fn=ATTN, seed=seed, shardings_fn=shardings_fn)
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(m))}, cfg


@pytest.mark.parametrize("kind", ["hf", "gguf", "dummy"])
def test_round_trip_is_bit_identical(root, kind):
    model, load_format = _source(kind, root)
    out = _converted(kind, root)
    assert resolve_model_path(out, "auto") == (out, "orbax")
    want, want_cfg = _weights(model, load_format)
    got, got_cfg = _weights(out)
    assert got_cfg == read_text_config(out) and got_cfg.num_hidden_layers == want_cfg.num_hidden_layers
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)
    meta = json.load(open(os.path.join(out, METADATA_FILE)))
    assert meta["format_version"] == FORMAT_VERSION and meta["dtype"] == "float32"
    assert meta["params"]["model.embed_tokens.embedding"]["shape"] == list(want["model.embed_tokens.embedding"].shape)
    assert meta["tokenizer"] is (kind != "dummy")


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_tokenizer_round_trips(root, kind):
    model, _ = _source(kind, root)
    src, got = load_tokenizer(resolve_model_path(model, "auto")[0]), load_tokenizer(_converted(kind, root))
    for text in ["hello world", "The quick brown fox, 42!", "  two  spaces\nnew line", "ünïcödé"]:
        assert got.encode(text) == src.encode(text), text
    chat = [{"role": "user", "content": "hello"}]
    assert got.apply_chat_template(chat, tokenize=False) == src.apply_chat_template(chat, tokenize=False)
    assert (got.bos_token_id, got.eos_token_id) == (src.bos_token_id, src.eos_token_id)


def test_restores_into_tp2_shardings(root):
    """Written from one device, read by two: each parameter lands with the rules table's sharding."""
    mesh = sharding.replica_meshes(sharding.make_mesh(2))[0]
    want, _ = _weights(*_source("hf", root))
    got, _ = _weights(_converted("hf", root), shardings_fn=sharding.shardings_fn(mesh))
    qkv = got["model.layers.0.self_attn.qkv_proj.kernel"]  # [D, K, G+2, Dh]
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, "model", None, None)
    assert {s.data.shape for s in qkv.addressable_shards} == {(qkv.shape[0], qkv.shape[1] // 2, *qkv.shape[2:])}
    assert got["model.norm.scale"].sharding.spec == jax.sharding.PartitionSpec(None)
    for name, array in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)


def test_other_dtype_casts_on_restore(root):
    want, _ = _weights(*_source("hf", root), dtype=jnp.bfloat16)
    got, _ = _weights(_converted("hf", root), dtype=jnp.bfloat16)
    for name, array in want.items():
        assert got[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)


def test_bfloat16_checkpoint(root):
    out = _converted("hf", root, "bfloat16")
    assert json.load(open(os.path.join(out, METADATA_FILE)))["dtype"] == "bfloat16"
    got, _ = _weights(out, dtype=jnp.bfloat16)
    want, _ = _weights(*_source("hf", root), dtype=jnp.bfloat16)
    for name, array in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)


# ------------------------------------------------------------------ errors


@pytest.fixture
def copy(root, tmp_path):
    """A fresh copy of the converted HF checkpoint, for a test to damage."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(_converted("hf", root), dst)
    return dst


def _load(path: str):
    return _weights(path)


def _edit_json(path: str, **changes) -> None:
    data = json.load(open(path))
    data.update(changes)
    json.dump(data, open(path, "w"))


def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    want = r"load_format='orbax' but model=.*nope.* does not exist; write it with `jaxserve convert SOURCE .*nope"
    with pytest.raises(ValueError, match=want):
        resolve_model_path(missing, "orbax")
    with pytest.raises(ValueError, match=r"was not found on disk.*`jaxserve convert`"):
        resolve_model_path(missing, "auto")
    with pytest.raises(CheckpointError, match=r"nope.* does not exist; re-run `jaxserve convert SOURCE"):
        load_model(missing, "orbax", dtype=jnp.float32, attention_fn=ATTN)


def test_unfinished_conversion(copy):
    os.remove(os.path.join(copy, METADATA_FILE))
    assert resolve_model_path(copy, "auto") == (copy, "orbax")  # the weights folder still says what it is
    want = rf"has no {METADATA_FILE}, so it is not a complete jaxserve checkpoint.*re-run `jaxserve convert"
    with pytest.raises(CheckpointError, match=want):
        _load(copy)


def test_missing_weights_folder(copy):
    shutil.rmtree(os.path.join(copy, "weights"))
    with pytest.raises(CheckpointError, match=r"has no weights/ folder.*re-run `jaxserve convert"):
        _load(copy)


def test_deleted_array_file(copy):
    victim = max(glob.glob(os.path.join(copy, "weights", "**", "d", "*"), recursive=True), key=os.path.getsize)
    os.remove(victim)
    rel = os.path.relpath(victim, copy)
    want = rf"incomplete or corrupt: missing files \[{rel}\].*re-run `jaxserve convert"
    with pytest.raises(CheckpointError, match=want):
        _load(copy)


def test_truncated_array_file(copy):
    victim = max(glob.glob(os.path.join(copy, "weights", "**", "d", "*"), recursive=True), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"incomplete or corrupt: changed sizes .*100 bytes, written as"):
        _load(copy)


def test_overwritten_array_file_is_a_read_error(copy):
    """Same size, other bytes (the OCDBT index no longer parses): orbax's error comes back naming the path."""
    for victim in glob.glob(os.path.join(copy, "weights", "**", "d", "*"), recursive=True):
        size = os.path.getsize(victim)
        with open(victim, "wb") as f:
            f.write(b"\0" * size)
    want = r"could not read the weights in .*weights.*damaged or incomplete.*re-run"
    with pytest.raises(CheckpointError, match=want):
        _load(copy)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(num_hidden_layers=3), r"parameters the config needs but the weights lack: \[model\.layers\.2\."),
        (dict(num_hidden_layers=1), r"saved parameters the config has no place for: \[model\.layers\.1\."),
        (dict(intermediate_size=96),
         r"shape mismatches: \[model\.layers\.0\.mlp\.down_proj\.kernel: config gives \(96, 64\), weights have \(128, 64\)"),
    ],
)
def test_edited_config(copy, change, match):
    _edit_json(os.path.join(copy, "config.json"), **change)
    with pytest.raises(CheckpointError, match=r"config\.json.* does not match the saved weights.*edited.*" + match):
        _load(copy)


def test_newer_format_version(copy):
    _edit_json(os.path.join(copy, METADATA_FILE), format_version=FORMAT_VERSION + 1, jaxserve_version="9.9")
    want = rf"format version {FORMAT_VERSION + 1} \(by jaxserve 9\.9\).*reads versions up to {FORMAT_VERSION}: upgrade"
    with pytest.raises(CheckpointError, match=want):
        read_text_config(copy)  # before the config is trusted (the TP check reads it before loading)


def test_wrong_load_format(root, copy):
    with pytest.raises(ValueError, match=r"load_format='safetensors' but .* is a jaxserve checkpoint"):
        resolve_model_path(copy, "safetensors")
    hf = _source("hf", root)[0]
    with pytest.raises(ValueError, match=r"load_format='orbax' but model=.* is not a directory written by"):
        resolve_model_path(hf, "orbax")
    with pytest.raises(ValueError, match=r"load_format='orbax' needs model= a directory written by `jaxserve convert`"):
        resolve_model_path(None, "orbax")


def test_out_dir_must_be_new(root, copy):
    with pytest.raises(ValueError, match=r"OUT_DIR .* already exists and is not empty"):
        convert(_source("hf", root)[0], copy)


def test_reconvert_to_another_dtype(root, tmp_path):
    """A converted directory is itself a source: converting it again changes the stored dtype."""
    out = str(tmp_path / "bf16")
    convert(_converted("hf", root), out, dtype="bfloat16")
    assert json.load(open(os.path.join(out, METADATA_FILE)))["source"]["format"] == "orbax"
    want, _ = _weights(*_source("hf", root), dtype=jnp.bfloat16)
    got, _ = _weights(out, dtype=jnp.bfloat16)
    for name, array in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)


def test_older_format_version_asks_for_reconversion(copy):
    """Version 1 stored q/k/v and gate/up apart; this jaxserve runs them fused and says to reconvert."""
    _edit_json(os.path.join(copy, METADATA_FILE), format_version=1, jaxserve_version="0.1.0")
    with pytest.raises(CheckpointError, match=r"format version 1 .*fuses q/k/v.*jaxserve convert"):
        read_text_config(copy)

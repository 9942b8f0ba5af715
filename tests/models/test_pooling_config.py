"""What an embedding directory declares (modules.json, 1_Pooling/config.json, config.json)."""

from __future__ import annotations

import json

import pytest

from jaxserve.models.loader.pooling_config import PoolingConfig, is_pooling_checkpoint, read_pooling_config

_ST = "sentence_transformers.models."


def _write(d, config=None, modules=None, pooling=None, st=None):
    (d / "config.json").write_text(json.dumps(config or {"model_type": "bert"}))
    if modules is not None:
        (d / "modules.json").write_text(json.dumps([{"type": _ST + m, "path": p} for m, p in modules]))
    if pooling is not None:
        (d / "1_Pooling").mkdir()
        (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if st is not None:
        (d / "sentence_bert_config.json").write_text(json.dumps(st))
    return str(d)


@pytest.mark.parametrize("pooling, want", [
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_lasttoken": True}, "last"),
    ({"pooling_mode": "lasttoken"}, "last"),
])  # fmt: skip
def test_sentence_transformers_pooling(tmp_path, pooling, want):
    path = _write(tmp_path, modules=[("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")],
                  pooling=pooling, st={"max_seq_length": 128})  # fmt: skip
    assert is_pooling_checkpoint(path)
    assert read_pooling_config(path, is_encoder=True) == PoolingConfig(want, True, 128, None)


def test_defaults_without_modules_and_matryoshka(tmp_path):
    enc = tmp_path / "enc"
    enc.mkdir()
    assert read_pooling_config(_write(enc), is_encoder=True) == PoolingConfig("cls", True)
    dec = tmp_path / "dec"
    dec.mkdir()
    path = _write(dec, config={"model_type": "qwen3", "architectures": ["Qwen3Model"], "is_matryoshka": True})
    assert is_pooling_checkpoint(path)
    assert read_pooling_config(path, is_encoder=False) == PoolingConfig("last", True, None, ())
    lm = tmp_path / "lm"
    lm.mkdir()
    assert not is_pooling_checkpoint(_write(lm, config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))


def test_what_is_not_implemented_is_named(tmp_path):
    a = tmp_path / "max"
    a.mkdir()
    path = _write(a, modules=[("Transformer", ""), ("Pooling", "1_Pooling")], pooling={"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooling_config(path, is_encoder=True)
    b = tmp_path / "dense"
    b.mkdir()
    path = _write(b, modules=[("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")],
                  pooling={"pooling_mode_mean_tokens": True})  # fmt: skip
    with pytest.raises(ValueError, match=r"modules \['Dense'\].*Dense projection is not supported"):
        read_pooling_config(path, is_encoder=True)

"""The fp32_matmul_precision engine option: validated, shown in --help, and passed to the model it builds."""

from __future__ import annotations

import argparse
import json

import jax
import pytest

from engine_fixtures import run_cache_dir

from jaxserve import model_loader
from jaxserve.cli import add_engine_args
from jaxserve.config import EngineArgs
from jaxserve.engine_setup import build_engine_components

# A tiny Llama config.json: load_format="dummy" builds random weights from it, no checkpoint needed.
_CONFIG = dict(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
)  # fmt: skip


def test_default_is_true_float32():
    assert EngineArgs().fp32_matmul_precision == "highest"


def test_bad_value_names_the_option_and_the_choices():
    want = r"fp32_matmul_precision='high' is invalid: choose one of \('highest', 'tf32'\)"
    with pytest.raises(ValueError, match=want):
        EngineArgs(fp32_matmul_precision="high").validate()


def test_help_shows_the_option():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--fp32-matmul-precision" in text and "tf32" in text and "(default: highest)" in text
    assert parser.parse_args(["--fp32-matmul-precision", "tf32"]).fp32_matmul_precision == "tf32"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("option,want", [("highest", jax.lax.Precision.HIGHEST), ("tf32", jax.lax.Precision.HIGH)])
def test_engine_builds_the_model_with_the_option(tmp_path, monkeypatch, option, want):
    (tmp_path / "config.json").write_text(json.dumps(_CONFIG))
    real_load = model_loader.load_model

    def load_and_stop(*args, **kwargs):
        model, _ = real_load(*args, **kwargs)
        attn = model.model.layers[0].self_attn
        raise _Stop(kwargs["fp32_matmul_precision"], attn.qkv_proj.precision, attn.precision, model.lm_head.precision)

    monkeypatch.setattr(model_loader, "load_model", load_and_stop)
    args = EngineArgs(
        model=str(tmp_path), load_format="dummy", dtype="float32", fp32_matmul_precision=option,
        attention_backend="reference", compilation_cache_dir=run_cache_dir(),
    )  # fmt: skip
    with pytest.raises(_Stop) as stop:  # stops before the KV cache and compiling: the model is what matters
        build_engine_components(args, progress=False)
    assert stop.value.args == (option, want, want, want)

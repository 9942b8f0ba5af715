"""`jaxserve convert` end to end: the converted directory serves the same greedy tokens as its source through
LLM (HF directory at TP=2 from a TP=1 conversion and GGUF, both against transformers; dummy weights against
the dummy source), and the CLI and `serve` take it."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import hf_greedy

from jaxserve import LLM, SamplingParams
from jaxserve.cli import build_parser, engine_args_from, main, parse_args
from jaxserve.model_loader import resolve_model_path

MAX_TOKENS = 8
_ROOT = tempfile.mkdtemp(prefix="jaxserve-convert-")
# few step shapes: each engine here compiles in a few seconds
_ENGINE = dict(max_model_len=48, max_num_seqs=1, max_num_batched_tokens=16)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, size=n).tolist() for n in (3, 21)]  # 21 > 16: a chunked prefill


@functools.lru_cache(maxsize=None)
def _greedy(model: str, load_format: str = "auto", tp: int = 1) -> tuple:
    llm = LLM(model, load_format=load_format, tensor_parallel_size=tp, seed=5, **small_engine_kwargs(**_ENGINE))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


def _convert_cli(*args: str) -> str:
    out = os.path.join(_ROOT, f"out{len(os.listdir(_ROOT))}")
    assert main(["convert", *args, out]) == 0
    return out


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
def test_hf_converted_at_tp1_serves_at_tp2_as_transformers():
    src = checkpoint("llama_gqa")
    out = _convert_cli(src, "--dtype", "float32")
    want = [tuple(hf_greedy(src, p, MAX_TOKENS, ignore_eos=True)) for p in _prompts()]
    assert list(_greedy(out, tp=2)) == want


def test_gguf_converted_serves_the_same_tokens():
    """The tiny GGUF holds the HF checkpoint's float32 tensors, so transformers on that checkpoint is the
    reference (the GGUF itself gives the same weights bit for bit: tests/models/test_orbax_checkpoint.py)."""
    from tiny_gguf import write_gguf_from_hf  # here: the GPU image may lack the gguf package

    src = checkpoint("llama_gqa")
    gguf_path = write_gguf_from_hf(src, os.path.join(_ROOT, "tiny.gguf"))
    out = _convert_cli(str(gguf_path))
    assert list(_greedy(out)) == [tuple(hf_greedy(src, p, MAX_TOKENS, ignore_eos=True)) for p in _prompts()]
    # its tokenizer came along: a text prompt works on the converted directory alone
    llm = LLM(out, **small_engine_kwargs(**_ENGINE, enforce_eager=True))
    assert llm.get_tokenizer().encode("hello world")[0] == 0  # <s>


def test_dummy_converted_serves_the_same_tokens():
    config_dir = os.path.join(_ROOT, "config_only")
    os.makedirs(config_dir)
    shutil.copyfile(os.path.join(checkpoint("llama_gqa"), "config.json"), os.path.join(config_dir, "config.json"))
    out = _convert_cli(config_dir, "--load-format", "dummy", "--seed", "5")
    assert _greedy(out) == _greedy(config_dir, "dummy")
    assert LLM(out, **small_engine_kwargs(**_ENGINE, enforce_eager=True)).get_tokenizer() is None


def test_cli_arguments():
    parser = build_parser()
    ns = parse_args(parser, ["convert", "/tmp/out"])
    assert (ns.model, ns.out_dir, ns.dtype, ns.load_format) == (None, "/tmp/out", "auto", "auto")
    ns = parse_args(parser, ["convert", "m.gguf", "--dtype", "bfloat16", "/tmp/out", "--load-format", "orbax"])
    assert (ns.model, ns.out_dir, ns.dtype, ns.load_format) == ("m.gguf", "/tmp/out", "bfloat16", "orbax")
    assert ns.func.__name__ == "_cmd_convert"


def test_serve_takes_a_converted_directory():
    try:
        import jaxserve.server.cli_args  # noqa: F401 - the server's extra dependencies
    except ImportError:
        pytest.skip("server dependencies (starlette, uvicorn) are not installed")
    out = _convert_cli(checkpoint("llama_mha_tied"))
    args = engine_args_from(build_parser().parse_args(["serve", out, "--load-format", "orbax"]))
    assert (args.model, args.load_format) == (out, "orbax")
    assert resolve_model_path(args.model, args.load_format) == (out, "orbax")


def test_convert_error_is_a_cli_error(capsys):
    assert main(["convert", os.path.join(_ROOT, "missing-model"), os.path.join(_ROOT, "never")]) == 2
    assert "was not found on disk" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(_ROOT, "never"))


def test_bench_load_times_source_and_converted(tmp_path):
    out_json = tmp_path / "load.json"
    argv = ["bench", "load", "--model", checkpoint("llama_gqa"), "--convert-to", str(tmp_path / "ckpt"),
            "--repeats", "1", "--cold", "--dtype", "float32", "--output-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out_json.read_text())
    assert [row["format"] for row in result["loads"]] == ["safetensors", "orbax"]
    for row in result["loads"]:
        assert row["gb"] > 0 and len(row["load_s"]) == 1 and row["disk_cold_gb_per_s"] > 0

"""Defaults that depend on who runs the engine (``EngineArgs.usage_context``) and the GEMM library policy of
large step programs on GPUs (``jaxserve.gemm_backend``): chosen on the H200, checked here on the CPU."""

from __future__ import annotations

import pytest

from jaxserve import gemm_backend
from jaxserve.bench.launch import engine_flags
from jaxserve.cli import build_parser
from jaxserve.config import EngineArgs
from jaxserve.engine_setup import default_max_num_batched_tokens
from jaxserve.model_runner import _step_name


def test_offline_llm_gets_the_bigger_budget_on_accelerators_only():
    assert default_max_num_batched_tokens("gpu", "llm") == 16384
    assert default_max_num_batched_tokens("tpu", "llm") == 16384
    assert default_max_num_batched_tokens("gpu", "engine") == 2048  # a server
    assert default_max_num_batched_tokens("cpu", "llm") == 256
    assert default_max_num_batched_tokens("cpu", "engine") == 256


def test_usage_context_is_checked_and_is_no_flag():
    with pytest.raises(ValueError, match="usage_context='server' is invalid: choose one of"):
        EngineArgs(usage_context="server").validate()
    with pytest.raises(SystemExit):  # no command takes it
        build_parser().parse_args(["serve", "--usage-context", "llm"])
    # A server started for an LLM's arguments gets no flag for it (`jaxserve serve` has none).
    assert engine_flags(EngineArgs(usage_context="llm", max_num_seqs=8)) == ["--max-num-seqs", "8"]


def test_llm_class_marks_itself_offline(monkeypatch):
    from jaxserve import llm as llm_mod

    seen = {}
    monkeypatch.setattr(llm_mod.LLMEngine, "from_engine_args", classmethod(lambda cls, a, progress: seen.setdefault("a", a)))
    llm_mod.LLM(model="x", usage_context="engine")  # the LLM class is offline whatever it is given
    assert seen["a"].usage_context == "llm"


def test_gemm_policy_by_platform_tokens_and_mode(monkeypatch):
    monkeypatch.delenv("JAXSERVE_TRITON_GEMM", raising=False)
    off = {"xla_gpu_enable_triton_gemm": False}
    assert gemm_backend.compiler_options("gpu", 256) == off and gemm_backend.compiler_options("gpu", 16384) == off
    assert gemm_backend.compiler_options("gpu", 128) is None  # few tokens: XLA's own choice
    assert gemm_backend.compiler_options("cpu", 4096) is None and gemm_backend.compiler_options("tpu", 4096) is None
    monkeypatch.setenv("JAXSERVE_TRITON_GEMM", "never")
    assert gemm_backend.compiler_options("gpu", 16) == off
    monkeypatch.setenv("JAXSERVE_TRITON_GEMM", "always")
    assert gemm_backend.compiler_options("gpu", 4096) is None
    monkeypatch.setenv("JAXSERVE_TRITON_GEMM", "sometimes")
    with pytest.raises(ValueError, match="JAXSERVE_TRITON_GEMM='sometimes' is not one of auto, always, never"):
        gemm_backend.compiler_options("gpu", 4096)


def test_store_names_tell_the_gemm_policy_apart():
    off = {"xla_gpu_enable_triton_gemm": False}
    assert _step_name((256, 4, True), None) == "step-t256-b4-decode"
    assert _step_name((256, 4, True), None, off) == "step-t256-b4-decode-cublas"
    assert _step_name((2048, 8, False), {"xla_gpu_enable_command_buffer": ""}, off) == "step-t2048-b8-nocb-cublas"

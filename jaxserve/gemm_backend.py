"""Which library runs a large step's matmuls on NVIDIA GPUs: cuBLAS, not XLA's Triton GEMM emitter.

XLA:GPU autotunes each matmul between its own Triton kernels and cuBLAS, one fusion at a time on synthetic
data. For steps of many tokens it kept some Triton kernels that run slower in the step than cuBLAS does. On the
H200 (Llama-3-8B shape, offline 256 x 512 -> 256), Triton GEMMs off for the whole process made the workload 0.8%
and 2.1% faster in two jobs, in the prompt steps (2,048 tokens) and the decode steps of 256 sequences alike. Off
for the large steps only, at the LLM class's 16,384-token budget: 9,809-9,868 against 9,764 output tok/s
(docs/BENCHMARKS.md §28). Steps of few tokens read weights rather than compute, and the single-stream decode
was tuned with XLA's choice: they keep it.

So the policy (``JAXSERVE_TRITON_GEMM``):

- ``auto`` (default): step programs of at least ``MIN_TOKENS`` tokens compile without Triton GEMMs;
- ``always``: XLA's default everywhere (its autotuner picks);
- ``never``: no Triton GEMMs in any step program.

Other platforms have no Triton GEMMs: nothing changes there.
"""

from __future__ import annotations

from jaxserve.launch_mode import env_mode

MIN_TOKENS = 256  # the decode bucket of 256 sequences and every prompt-sized step
_NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def mode() -> str:
    return env_mode("JAXSERVE_TRITON_GEMM")


def compiler_options(platform: str, tokens: int) -> dict | None:
    """XLA options for a step program of ``tokens`` (padded) tokens compiled for ``platform``; None: none."""
    if platform != "gpu":
        return None
    m = mode()
    if m == "never" or (m == "auto" and tokens >= MIN_TOKENS):
        return dict(_NO_TRITON_GEMM)
    return None


def describe(options: dict | None) -> str:
    """A tag for executable-store names: programs compiled with other options must not be loaded."""
    return "-cublas" if options else ""

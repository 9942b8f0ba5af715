"""Which precision the model's matmuls ask for: float32 means float32, on every device.

Without an explicit precision JAX leaves a float32 matmul to the backend, and on NVIDIA GPUs that is
TF32 (10-bit mantissa inputs, ~1e-3 relative error), where PyTorch (hence HF transformers and vLLM)
computes true float32 by default. A float32 model therefore asks for ``Precision.HIGHEST`` on every matmul,
explicitly at each call, rather than through ``jax_default_matmul_precision``, which would change the
user's own code in the same process too.

TF32 stays available as an opt-in (``fp32_matmul_precision="tf32"``): it maps to ``Precision.HIGH``,
which XLA:GPU and Pallas's Triton lowering both run as TF32 (``DEFAULT`` would mean one bf16 pass on a
TPU, where ``HIGH`` is bf16 x3, the closest to TF32 there). On CPU every choice computes float32.

bfloat16 and float16 models keep JAX's default (``None``): the same programs as before this option existed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Mirrored by jaxserve.config (which imports no JAX); a test keeps the two equal.
FP32_MATMUL_PRECISIONS = ("highest", "tf32")

_FP32_PRECISION = {"highest": lax.Precision.HIGHEST, "tf32": lax.Precision.HIGH}


def matmul_precision(dtype, fp32_matmul_precision: str = "highest") -> lax.Precision | None:
    """The ``precision=`` for the matmuls of a model computing in ``dtype``: HIGHEST for float32
    (HIGH with ``fp32_matmul_precision="tf32"``), None (JAX's default) for bf16/fp16."""
    if fp32_matmul_precision not in _FP32_PRECISION:
        raise ValueError(
            f"fp32_matmul_precision={fp32_matmul_precision!r} is invalid: choose one of {FP32_MATMUL_PRECISIONS}"
        )
    if jnp.dtype(dtype) != jnp.float32:
        return None
    return _FP32_PRECISION[fp32_matmul_precision]


def resolve(precision: lax.Precision | None, dtype) -> lax.Precision | None:
    """An attention backend's precision: the caller's, or when it gives none, the one ``dtype`` implies
    (so a float32 call is exact by default, as the model's own matmuls are)."""
    return precision if precision is not None else matmul_precision(dtype)

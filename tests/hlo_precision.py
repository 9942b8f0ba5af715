"""Read the precision of every matmul in a lowered JAX program (``jax.jit(f).lower(...).as_text()``).

TEST-ONLY. StableHLO writes a dot's precision as ``precision = [LHS, RHS]`` (DEFAULT when the caller gave
none), so a float32 program that runs true float32 on a GPU shows only HIGHEST.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re

_PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")


def dot_precisions(hlo_text: str) -> collections.Counter:
    """How many dot_general ops the program has at each precision ("LHS" when both operands agree)."""
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        m = _PRECISION.search(line)
        if m is None:
            counts["none"] += 1
        else:
            counts[m.group(1) if m.group(1) == m.group(2) else f"{m.group(1)},{m.group(2)}"] += 1
    return counts


@contextlib.contextmanager
def jnp_attention():
    """The attention backends as the GPU and TPU trace them: on the CPU the `xla` backend hands its attention to a
    C++ kernel (cpu_native.py), which has no dots to read (it sums in float32, as HIGHEST does). Within this block
    the kernels are off, so the backend's jnp routes, whose dots carry the precision, are traced."""
    from jaxserve.pallas_kernels import attention, cpu_native

    before = os.environ.get("JAXSERVE_CPU_KERNELS")
    os.environ["JAXSERVE_CPU_KERNELS"] = "0"
    attention.get_attention_fn.cache_clear()
    cpu_native.loaded.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["JAXSERVE_CPU_KERNELS"]
        else:
            os.environ["JAXSERVE_CPU_KERNELS"] = before
        attention.get_attention_fn.cache_clear()
        cpu_native.loaded.cache_clear()

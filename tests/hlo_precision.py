"""Read the precision of every matmul in a lowered JAX program (``jax.jit(f).lower(...).as_text()``).

TEST-ONLY. StableHLO writes a dot's precision as ``precision = [LHS, RHS]`` (DEFAULT when the caller gave
none), so a float32 program that runs true float32 on a GPU shows only HIGHEST.
"""

from __future__ import annotations

import collections
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

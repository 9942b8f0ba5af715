"""Products of a few rows on the CPU: XLA:CPU's dot against jaxserve's native few-row kernel, by row count.

    python -m jaxserve.bench.cpu_gemm_rows [--rows 2,4,8,16,32,40,48,64,96,128,256] [--layers 30] [--rounds 7]
        [--out rows.json] [--quick]

A decode step of M sequences multiplies M rows by every weight. Each row count runs the default model's four
projections (576 -> 960, 576 -> 576, 576 -> 3072, 1536 -> 576), ``--layers`` layers' worth of distinct weights
(more bytes than the caches hold), chained in one jitted program so that each product waits for the last; the two
ways alternate round by round and the median is reported:

- ``xla``: ``jnp.dot`` at precision highest (what the model traces outside a native-products step).
- ``native``: ``cpu_native.gemm`` (``pallas_kernels/cpu_gemm.cc``), what a decode step of 2 to
  ``cpu_native.GEMM_MAX_ROWS`` rows runs on one device.
- ``codes`` and ``codes_dequantized`` (``--quantized``): the same products with GGUF-style block-quantized weights
  (int8 codes, a scale and offset per 32 rows of the weight; models/quantized.py), by ``cpu_native.qgemm``
  (``pallas_kernels/cpu_qgemm.cc``) and by ``cpu_native.dequantize`` followed by XLA's product: the two ways a
  model kept quantized multiplies, below and above ``cpu_native.QGEMM_MAX_ROWS``.

docs/BENCHMARKS.md §37 has the numbers; ``--quick`` shrinks everything for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels import cpu_native

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2-135M's qkv, o, gate-up and down


def _chain(product, layers: int):
    """One jitted program: every layer's four products, each input nudged by the last output (an order XLA keeps)."""

    def run(xs, weights):
        acc = jnp.float32(0.0)
        for layer in range(layers):
            for x, w in zip(xs, weights[layer]):
                acc = acc + product(x + acc * 1e-30, w)[0, 0]
        return acc

    return jax.jit(run)


def _xla(x, w):
    return jnp.dot(x, w, precision="highest")


def _codes(rng, k: int, n: int):
    """A random block-quantized weight [k, n]: int8 codes in Q4_1's range, a scale and an offset per 32 rows."""
    scale = jnp.asarray(rng.standard_normal((k // 32, n)) * 0.01, jnp.float32)
    offset = jnp.asarray(rng.standard_normal((k // 32, n)) * 0.01, jnp.float32)
    return jnp.asarray(rng.integers(0, 16, (k, n)), jnp.int8), scale, offset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.cpu_gemm_rows", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2,4,8,16,32,40,48,64,96,128,256", help="row counts, comma-separated")
    p.add_argument("--layers", type=int, default=30, help="layers of distinct weights in the chain (default 30)")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is reported (default 7)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="2 layers, 2 rounds, rows 2 and 8: a smoke test")
    p.add_argument("--quantized", action="store_true",
                   help="also block-quantized weights: cpu_native.qgemm, and dequantized then XLA's product")
    ns = p.parse_args(argv)
    try:
        rows = [int(r) for r in ns.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        p.error(f"--rows={ns.rows!r}: give positive row counts, comma-separated, e.g. 16,32,48")
    layers, rounds = (2, 2) if ns.quick else (ns.layers, ns.rounds)
    rows = [2, 8] if ns.quick else rows
    rng = np.random.default_rng(0)
    weights = [[jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for k, n in SHAPES] for _ in range(layers)]
    ways = {"xla": (_chain(_xla, layers), weights)}
    if cpu_native.loaded("gemm"):
        ways["native"] = (_chain(cpu_native.gemm, layers), weights)
    else:
        print("the native kernel is not built here (no compiler, or JAXSERVE_CPU_KERNELS): XLA only")
    if ns.quantized and cpu_native.loaded("qgemm"):
        blocks = [[_codes(rng, k, n) for k, n in SHAPES] for _ in range(layers)]
        ways["codes"] = (_chain(lambda x, w: cpu_native.qgemm(x, *w), layers), blocks)
        ways["codes_dequantized"] = (_chain(lambda x, w: _xla(x, cpu_native.dequantize(*w)), layers), blocks)
    results = []
    for m in rows:
        xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.float32) for k, _ in SHAPES]
        for fn, w in ways.values():
            fn(xs, w).block_until_ready()  # compile
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, (fn, w) in ways.items():
                start = time.perf_counter()
                fn(xs, w).block_until_ready()
                times[name].append(time.perf_counter() - start)
        flops = 2 * m * sum(k * n for k, n in SHAPES) * layers
        row = {"rows": m}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[name] = {"ms": t * 1e3, "gflops": flops / t / 1e9}
        results.append(row)
        print(f"M={m:4d} " + "  ".join(f"{name} {row[name]['ms']:7.1f} ms ({row[name]['gflops']:6.1f} GF/s)"
                                       for name in ways), flush=True)  # fmt: skip
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"layers": layers, "rounds": rounds, "shapes": SHAPES, "rows": results,
                       "jax": jax.__version__}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight-only quantized GEMVs through XLA, against bf16: does reading int8 or fp8 weights make a draft pass faster?

    python -m jaxserve.bench.weight_only_gemv [--kinds bf16,int8,fp8,fp8xfp8] [--rows 1,5] [--out rows.json] [--quick]

A draft model's pass is a chain of small matmuls (Llama-3.2-1B widths: 16 layers of q/k/v, o, gate-up and down,
then the 128k-vocabulary head, 2.47 GB in bf16). Weight-only int8 or fp8 halves the bytes; whether it halves the
time depends on XLA fusing the dequantization into the product. Each kind runs that chain (distinct weights per
layer, more bytes than the L2 cache) inside one jitted call: ``int8``/``fp8`` convert the weight to bf16 in the
product and scale the output by per-column scales; ``fp8xfp8`` also quantizes the activations per row (XLA's
scaled fp8 matmul). Rows 1 and 5: a lone decode token and k + 1 tokens. Also recorded: what XLA lowered one
product of each kind to. ``--quick`` shrinks the widths for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

FULL = dict(d=2048, f=8192, v=128256, qkv=3072, layers=16)  # Llama-3.2-1B
QUICK = dict(d=64, f=128, v=512, qkv=96, layers=2)
FP8_MAX = 448.0  # float8_e4m3fn


def _quantize(w: jax.Array, kind: str):
    """(weight as stored, per-column scale or None)."""
    if kind == "bf16":
        return w.astype(jnp.bfloat16), None
    amax = jnp.maximum(jnp.abs(w).max(axis=0), 1e-12)
    if kind == "int8":
        s = amax / 127.0
        return jnp.round(w / s).astype(jnp.int8), s
    s = amax / FP8_MAX  # fp8, fp8xfp8
    return (w / s).astype(jnp.float8_e4m3fn), s


def _product(x: jax.Array, w, kind: str) -> jax.Array:
    q, s = w
    if kind == "bf16":
        return x @ q
    if kind == "fp8xfp8":
        sx = jnp.maximum(jnp.abs(x).max(axis=-1, keepdims=True).astype(jnp.float32), 1e-12) / FP8_MAX
        y = jax.lax.dot(jnp.asarray(x / sx, jnp.float8_e4m3fn), q, preferred_element_type=jnp.float32)
        return (y * sx * s).astype(jnp.bfloat16)
    y = jax.lax.dot(x, q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (y * s).astype(jnp.bfloat16)


def weights(shape: dict, kind: str) -> list:
    d, f = shape["d"], shape["f"]
    mats = [(d, shape["qkv"]), (d, d), (d, 2 * f), (f, d)] * shape["layers"] + [(d, shape["v"])]
    key = jax.random.PRNGKey(0)
    return [_quantize(jax.random.normal(jax.random.fold_in(key, i), m, jnp.float32) * 0.02, kind) for i, m in enumerate(mats)]


def chain(shape: dict, kind: str):
    d, f = shape["d"], shape["f"]

    def run(x, ws):
        h = x
        for i in range(shape["layers"]):
            a = _product(h, ws[4 * i], kind)[:, :d]
            h = h + _product(a, ws[4 * i + 1], kind)
            g = _product(h, ws[4 * i + 2], kind)
            h = h + _product(jax.nn.silu(g[:, :f]) * g[:, f:], ws[4 * i + 3], kind)
        return _product(h, ws[-1], kind)

    return jax.jit(run)


def lowered_to(shape: dict, ws, kind: str) -> list[str]:
    """What one product compiled to: its custom calls and fusion kinds (e.g. a Triton GEMM fusion, cuBLASLt fp8)."""
    text = jax.jit(lambda x, w: _product(x, w, kind)).lower(jnp.zeros((1, shape["d"]), jnp.bfloat16), ws[2]).compile().as_text()
    return sorted(set(re.findall(r'"(?:kind|name)":"(__[\w$]+)"', text)) | set(re.findall(r'custom_call_target="([^"]+)"', text)))


def time_kind(shape: dict, kind: str, rows: list[int], reps: int = 20) -> list[dict]:
    ws = weights(shape, kind)
    fn, nbytes = chain(shape, kind), sum(q.nbytes + (0 if s is None else s.nbytes) for q, s in ws)
    out = []
    for m in rows:
        x = (jax.random.normal(jax.random.PRNGKey(m), (m, shape["d"])) * 0.5).astype(jnp.bfloat16)
        for _ in range(3):
            fn(x, ws).block_until_ready()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                y = fn(x, ws)
            y.block_until_ready()
            times.append((time.perf_counter() - t0) / reps)
        sec = statistics.median(times)
        out.append(dict(kind=kind, rows=m, ms=sec * 1e3, weight_gb=nbytes / 1e9, weight_tb_per_s=nbytes / sec / 1e12))
    out[0]["lowered_to"] = lowered_to(shape, ws, kind)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.weight_only_gemv", description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="bf16,int8,fp8,fp8xfp8")
    p.add_argument("--rows", default="1,5")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny widths (a CPU smoke test)")
    ns = p.parse_args(argv)
    shape = QUICK if ns.quick else FULL
    rows = []
    for kind in ns.kinds.split(","):
        if kind not in ("bf16", "int8", "fp8", "fp8xfp8"):
            p.error(f"--kinds: {kind!r} is not one of bf16, int8, fp8, fp8xfp8")
        for row in time_kind(shape, kind, [int(r) for r in ns.rows.split(",")], reps=2 if ns.quick else 20):
            print(json.dumps(row), flush=True)
            rows.append(row)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": shape, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

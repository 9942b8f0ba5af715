"""One-row products on XLA:CPU: which way of storing and multiplying a weight reads it fastest?

    python -m jaxserve.bench.cpu_gemv_forms [--shapes 576x3072,576x960,576x576,1536x576] [--forms f32,f32_t,...]
        [--layer-forms NNNN,TNNT] [--rounds 15] [--out rows.json] [--quick]

A single-stream decode step on the CPU is a chain of one-row products, one weight each, read from memory once
(goal 5 of issue 11 divides its speed by the weight bytes' read time). Each form runs a 30-product chain of one
[K -> N] shape with distinct weights (more bytes than the caches hold) in one jitted call, forms alternated
round by round, and reports the median time per product and the weight bytes read per second:

- ``f32``: ``x @ W``, W stored [K, N] (the engine's kernel layout, ``models/layers.py``).
- ``f32_t``: W stored transposed, [N, K], as a matrix-vector product ``W @ x``.
- ``int8_dot``: int8 weights with per-column scales, converted to float32 inside the product.
- ``int8_reduce``: int8 stored [N, K]; convert, multiply and sum over K in one fusion (no dot).
- ``int8_reduce_major``: int8 stored [K, N]; the same, summing over the major axis.
- ``s8s8``: the row quantized to int8 too, an int8 x int8 -> int32 dot.
- ``bf16``: bf16 weights, float32 accumulation (half the bytes).
- ``native``: W stored [K, N], jaxserve's C++ one-row product (``pallas_kernels/cpu_gemv.cc``), as a
  single-stream decode step runs it.

``--layer-forms`` also times 30 layers of the default model's four products (qkv, o, gate-up, down) with
SiLU and a norm between them, each product ``N`` (``x @ W``), ``T`` (stored transposed) or ``G`` (the native
kernel), e.g. ``TNNT``. ``--quick`` shrinks everything for a smoke test. docs/BENCHMARKS.md §35 and §36 have the
numbers.
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

FORMS = ("f32", "f32_t", "int8_dot", "int8_reduce", "int8_reduce_major", "s8s8", "bf16", "native")
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2-135M: qkv, o, gate-up, down
_BYTES = {"f32": 4, "f32_t": 4, "bf16": 2, "native": 4}  # int8 forms: 1 (scales not counted: N floats a product)


def _store(w: np.ndarray, form: str):
    """The weight as the form keeps it: (array, per-column scale or None)."""
    if form in ("f32", "native"):
        return jnp.asarray(w), None
    if form == "f32_t":
        return jnp.asarray(w.T.copy()), None
    if form == "bf16":
        return jnp.asarray(w, jnp.bfloat16), None
    scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0
    q = np.round(w / scale).astype(np.int8)
    return jnp.asarray(q.T.copy() if form == "int8_reduce" else q), jnp.asarray(scale, jnp.float32)


def _product(form: str, x: jax.Array, w: jax.Array, scale) -> jax.Array:  # x [1, K] -> [1, N] float32
    hi = jax.lax.Precision.HIGHEST
    if form == "f32":
        return jnp.dot(x, w, precision=hi)
    if form == "f32_t":
        return jnp.dot(w, x[0], precision=hi)[None]
    if form == "native":
        return cpu_native.matvec(x, w)
    if form == "bf16":
        return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    if form == "int8_dot":
        return jnp.dot(x, w.astype(jnp.float32), precision=hi) * scale
    if form == "int8_reduce":
        return jnp.sum(w.astype(jnp.float32) * x, axis=1)[None] * scale
    if form == "int8_reduce_major":
        return jnp.sum(x[0][:, None] * w.astype(jnp.float32), axis=0)[None] * scale
    if form == "s8s8":
        xs = jnp.maximum(jnp.abs(x).max(), 1e-12) / 127.0
        xq = jnp.round(x / xs).astype(jnp.int8)
        y = jax.lax.dot(xq, w, preferred_element_type=jnp.int32)
        return y.astype(jnp.float32) * (scale * xs)
    raise ValueError(f"unknown form {form!r}; known: {', '.join(FORMS)}")


def _timed(fns: dict, rounds: int) -> dict:
    """Median and best seconds of each zero-argument function, the order alternated round by round."""
    for f in fns.values():
        jax.block_until_ready(f())  # compile and warm
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k]())
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(t), min(t)) for k, t in times.items()}


def _product_chain(form: str, weights: list[np.ndarray], x0: jax.Array):
    """A zero-argument function running the chain of products, one per weight, in one jitted call."""
    stored = [_store(w, form) for w in weights]
    n = weights[0].shape[1]

    @jax.jit
    def run(x, stored):
        acc = jnp.zeros((1, n), jnp.float32)
        for w, s in stored:
            y = _product(form, x, w, s)
            acc = acc + y
            x = x + 1e-3 * jnp.sum(y)  # each product waits for the one before
        return acc

    return lambda: run(x0, stored)


def product_rows(shapes, forms, layers: int, rounds: int, seed: int = 0) -> list[dict]:
    rows = []
    for k, n in shapes:
        rng = np.random.default_rng(seed)
        weights = [rng.standard_normal((k, n), dtype=np.float32) * 0.03 for _ in range(layers)]
        x0 = jnp.asarray(rng.standard_normal((1, k), dtype=np.float32))

        fns = {form: _product_chain(form, weights, x0) for form in forms}
        exact = np.asarray(_product_chain("f32", weights, x0)())
        timed = _timed(fns, rounds)
        for form in forms:
            med, best = timed[form]
            err = float(np.abs(np.asarray(fns[form]()) - exact).max() / np.abs(exact).max())
            nbytes = layers * k * n * _BYTES.get(form, 1)
            rows.append(dict(shape=f"{k}x{n}", form=form, us_per_product=med / layers * 1e6,
                             best_us_per_product=best / layers * 1e6, weight_bytes=nbytes,
                             gb_per_s=nbytes / med / 1e9, rel_err=err))  # fmt: skip
    return rows


def layer_rows(layer_forms, layers: int, rounds: int, shapes=LAYER_SHAPES, seed: int = 0) -> list[dict]:
    """30 layers of the four products, each stored [in, out] (N), [out, in] (T), or [in, out] through the native
    kernel (G)."""
    rng = np.random.default_rng(seed)
    d, f = shapes[0][0], shapes[3][0]  # hidden and intermediate widths
    weights = [[rng.standard_normal(s, dtype=np.float32) * 0.03 for s in shapes] for _ in range(layers)]

    def chain(forms):
        stored = [[jnp.asarray(w.T.copy() if c == "T" else w) for w, c in zip(ws, forms)] for ws in weights]

        def prod(x, w, c):
            if c == "G":
                return cpu_native.matvec(x, w)
            return jnp.dot(x, w) if c == "N" else jnp.dot(w, x[0])[None]

        @jax.jit
        def run(x, stored):
            for ws in stored:
                q = prod(x, ws[0], forms[0])
                h = x + prod(q[:, :d], ws[1], forms[1])
                g = prod(h, ws[2], forms[2])
                a = jax.nn.silu(g[:, :f]) * g[:, f:]
                x = h + prod(a, ws[3], forms[3])
                x = x * jax.lax.rsqrt(jnp.mean(x * x) + 1e-6)
            return x

        x0 = jnp.ones((1, d), jnp.float32)
        return lambda: run(x0, stored)

    fns = {forms: chain(forms) for forms in layer_forms}
    timed = _timed(fns, rounds)
    nbytes = layers * sum(a * b for a, b in shapes) * 4
    return [dict(layer_forms=k, ms=med * 1e3, best_ms=best * 1e3, weight_bytes=nbytes, gb_per_s=nbytes / med / 1e9)
            for k, (med, best) in timed.items()]  # fmt: skip


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: give KxN pairs separated by commas, e.g. 576x3072,1536x576")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.cpu_gemv_forms", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="576x3072,576x960,576x576,1536x576", help="KxN products, comma-separated")
    p.add_argument("--forms", default=None, help=f"comma-separated, of: {', '.join(FORMS)} (default: all; native "
                   "where jaxserve's C++ kernel builds)")
    p.add_argument("--layer-forms", default="", help="also time whole layers, e.g. NNNN,GGGG (N: x @ W, T: W @ x, G: the native kernel)")
    p.add_argument("--layers", type=int, default=30, help="products (or layers) in each chain")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny widths and few rounds (smoke test)")
    ns = p.parse_args(argv)
    forms = ns.forms.split(",") if ns.forms else [f for f in FORMS if f != "native" or cpu_native.loaded("gemv")]
    for form in forms:
        if form not in FORMS:
            p.error(f"--forms: unknown form {form!r}; known: {', '.join(FORMS)}")
    for lf in filter(None, ns.layer_forms.split(",")):
        if len(lf) != 4 or set(lf) - {"N", "T", "G"}:
            p.error(f"--layer-forms: {lf!r} must be four letters N, T or G (qkv, o, gate-up, down), e.g. TNNT")
    if ("native" in forms or "G" in ns.layer_forms) and not cpu_native.loaded("gemv"):
        p.error("the native form needs jaxserve's C++ kernel, which did not build here (see the warning above)")
    shapes, layers, rounds = _shapes(ns.shapes), ns.layers, ns.rounds
    layer_shapes = LAYER_SHAPES
    if ns.quick:
        shapes, layers, rounds = [(32, 64)], 2, 3
        layer_shapes = ((32, 48), (32, 32), (32, 96), (48, 32))
    rows = product_rows(shapes, forms, layers, rounds)
    for r in rows:
        print(f"{r['shape']:>9s} {r['form']:18s} {r['us_per_product']:8.1f} us/product (best {r['best_us_per_product']:7.1f})"
              f" {r['gb_per_s']:6.1f} GB/s of its own bytes, rel. error {r['rel_err']:.1e}")  # fmt: skip
    lrows = layer_rows([lf for lf in ns.layer_forms.split(",") if lf], layers, rounds, layer_shapes)
    for r in lrows:
        print(f"layers {r['layer_forms']}: {r['ms']:7.2f} ms a chain (best {r['best_ms']:.2f}), {r['gb_per_s']:5.1f} GB/s")
    if ns.out:
        meta = dict(jax=jax.__version__, device=str(jax.devices()[0]), layers=layers, rounds=rounds)
        with open(ns.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, layer_rows=lrows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

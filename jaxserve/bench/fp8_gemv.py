"""fp8 weight products of a few rows on the GPU: the Pallas kernel (pallas_kernels/fp8_gemv.py) against XLA.

    python -m jaxserve.bench.fp8_gemv [--model llama3-8b] [--rows 16,32,64] [--sweep] [--out OUT.json] [--quick]

For each of the model's products (qkv, o, gate-up, down, head; head_t is a tied head, the table [N, K]) and row count: XLA's bf16 product, XLA's product
with the fp8 weight converted inside (``x @ convert(w) * s``), and the kernel (its default configuration, and with
``--sweep`` every configuration of a grid, to choose the defaults). Each is timed over enough distinct weight
copies to exceed the L2 cache, so every product reads its weight from memory; the table gives ms per product and
the weight bytes read per second. ``--quick`` runs tiny widths in interpret mode (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxserve.pallas_kernels import fp8_gemv as kern

SHAPES = {  # name -> (K, N) of each product, fused as jaxserve's Llama holds them
    "llama3-8b": dict(qkv=(4096, 6144), o=(4096, 4096), gate_up=(4096, 28672), down=(14336, 4096), head=(4096, 128256)),
    "llama3.2-1b": dict(qkv=(2048, 3072), o=(2048, 2048), gate_up=(2048, 16384), down=(8192, 2048), head_t=(2048, 128256)),
    "quick": dict(qkv=(256, 384), down=(512, 256), head_t=(256, 512)),
}
TRANSPOSED = {"head_t"}  # a tied head: the embedding table [N, K] read as the product's weight
FP8_MAX = 448.0
MIN_BYTES = 512 << 20  # weight copies per timing: at least this many bytes (H100/H200 L2: 50-60 MB)


def quantize(w: jax.Array, axis: int = 0):
    s = jnp.maximum(jnp.abs(w).max(axis=axis, keepdims=True), 1e-12) / FP8_MAX
    return (w / s).astype(jnp.float8_e4m3fn), s.reshape(-1).astype(jnp.float32)


def _time(fn, args, reps: int) -> float:
    """Seconds a call: ``reps`` calls queued back to back, so the host's dispatch of one overlaps the device's run
    of the one before, and only the device's time is counted."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def run_shape(k: int, n: int, rows: int, configs, *, reps: int, interpret: bool, transposed: bool = False) -> list[dict]:
    copies = max(1, -(-MIN_BYTES // (k * n))) if not interpret else 1
    keys = jax.random.split(jax.random.PRNGKey(k * 7 + n), copies + 1)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    ws = [jax.random.normal(kk, (n, k) if transposed else (k, n), jnp.float32) * 0.02 for kk in keys[1:]]
    qs = [quantize(w, axis=1 if transposed else 0) for w in ws]
    bf = [w.astype(jnp.bfloat16) for w in ws]
    del ws

    def chain(product):
        @jax.jit
        def f(x, weights):
            acc = jnp.zeros((rows, n), jnp.float32)
            for w in weights:
                acc = acc + product(x, w).astype(jnp.float32)
            return acc

        return f

    results = []

    def record(kind, product, weights, nbytes, config=None):
        try:
            t = _time(chain(product), (x, weights), reps) / copies
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses is skipped, with its reason
            results.append(dict(kind=kind, config=config, error=str(e)[:200]))
            return
        results.append(dict(kind=kind, config=config, ms=t * 1e3, tbps=nbytes / t / 1e12))

    if not interpret:
        t = (lambda w: w.T) if transposed else (lambda w: w)
        record("xla_bf16", lambda x, w: x @ t(w), bf, 2 * k * n)
        record("xla_fp8", lambda x, w: (jnp.dot(x, t(w[0].astype(x.dtype)), preferred_element_type=jnp.float32) * w[1]).astype(x.dtype), qs, k * n)
    for cfg in configs:
        if cfg is not None and not kern.fits(k, n, cfg):
            continue
        record("pallas_fp8", lambda x, w, cfg=cfg: kern.fp8_gemv(x, w[0], w[1], x.dtype, transposed=transposed, config=cfg, interpret=interpret),
               qs, k * n, None if cfg is None else cfg.__dict__)
        if cfg is None or kern.fits(k, n, cfg):  # the same weight stored output-major: [N, K]
            qt = qs if transposed else [(q.T, s) for q, s in qs]
            record("pallas_fp8_nk", lambda x, w, cfg=cfg: kern.fp8_gemv_nk(x, w[0], w[1], x.dtype, config=cfg, interpret=interpret),
                   qt, k * n, None if cfg is None else cfg.__dict__)
    return results


def sweep_configs():
    tiles = ((128, 256, 4, 3), (64, 256, 4, 3), (128, 128, 4, 4), (256, 128, 8, 3))
    return [kern.GemvConfig(block_n=bn, block_k=bk, splits=s, num_warps=nw, num_stages=st)
            for (bn, bk, nw, st), s in itertools.product(tiles, (1, 2, 4))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--products", default=None, help="comma-separated subset of the model's products")
    ap.add_argument("--sweep", action="store_true", help="time every kernel configuration of a grid at the first row count")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    model = "quick" if args.quick else args.model
    rows = [int(r) for r in args.rows.split(",")]
    shapes = SHAPES[model]
    names = args.products.split(",") if args.products else list(shapes)
    out = dict(model=model, device=str(jax.devices()[0].device_kind), jax=jax.__version__, results=[])
    for name in names:
        k, n = shapes[name]
        for i, r in enumerate(rows):
            configs = [None] + (sweep_configs() if args.sweep and i == 0 else [])
            res = run_shape(k, n, r, configs, reps=args.reps, interpret=args.quick, transposed=name in TRANSPOSED)
            for item in res:
                item.update(product=name, k=k, n=n, rows=r)
            out["results"] += res
            ok = [x for x in res if "ms" in x]
            best = min((x for x in ok if x["kind"].startswith("pallas_fp8")), key=lambda x: x["ms"], default=None)
            line = {x["kind"]: round(x["ms"], 4) for x in ok if x["config"] is None}
            print(f"{name} [{k}x{n}] rows {r}: {line}" + (f" best kernel {best['kind']} {best['ms']:.4f} ms {best['tbps']:.2f} TB/s "
                  f"{best['config']}" if best else ""), flush=True)  # fmt: skip
            if args.out:  # after every shape: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

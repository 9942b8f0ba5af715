"""Decode attention over an fp8 KV cache against a bf16 one (issue 15): same batch, same kernels.

    python -m jaxserve.bench.attention_fp8 [--cases 64x4096,256x2048] [--formats fp8_e4m3,fp8_e5m2] [--quick]

Each case is B sequences decoding one token over a context of C tokens (Llama-3-8B attention shapes).
The timed call is the pallas backend's attention without the KV write (``ragged_attention_gpu``) plus
the fp8 path's scale folding, as the engine's step runs it. Reported: microseconds, the cache bytes read
per second (each sequence's K and V once, in the cache's own dtype), the speedup over bf16 (the goal:
>= 1.7x, half the bytes) and the error against the float32 reference over the same (dequantized) cache.
``--quick`` shrinks the shapes and interprets the kernels: a CPU smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.attention import D, H, K, P, rel_err, time_fn
from jaxserve.pallas_kernels import fp8
from jaxserve.pallas_kernels.paged_attention_pallas import ragged_attention_gpu
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference


def _attention(q, k, v, md, *, k_scale, v_scale, interpret):
    """The pallas backend's read path over any cache (fp8: scales folded into q and the output)."""
    if fp8.is_fp8(k.dtype):
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)
    out = ragged_attention_gpu(q, k, v, md, scale=D**-0.5, interpret=interpret)
    return (out.astype(jnp.float32) * v_scale).astype(out.dtype) if fp8.is_fp8(k.dtype) else out


def run_case(num_seqs: int, ctx: int, formats: list[str], quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    batch = make_batch(
        rng, q_lens=[1] * num_seqs, ctx_lens=[ctx] * num_seqs, num_heads=H, num_kv_heads=K, head_dim=D, block_size=P,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, decode_only=True))
    rows = []
    for name in ["auto"] + formats:
        dtype = fp8.kv_cache_dtype_for(name, jnp.bfloat16)
        k, v = fp8.quantize(batch.k_pages, 1.0, dtype), fp8.quantize(batch.v_pages, 1.0, dtype)
        fn = jax.jit(lambda q, k, v, md: _attention(q, k, v, md, k_scale=1.0, v_scale=1.0, interpret=quick))
        with jax.default_matmul_precision("highest"):
            ref = ragged_paged_attention_reference(batch.q, k, v, batch.md, scale=D**-0.5)
        err = rel_err(fn(batch.q, k, v, batch.md), ref)
        sec = time_fn(fn, batch.q, k, v, batch.md, reps=50, rounds=7)
        kv_bytes = 2 * num_seqs * ctx * K * D * dtype.itemsize
        rows.append({"case": f"B={num_seqs} ctx={ctx}", "kv_cache_dtype": name, "us": sec * 1e6,
                     "kv_tbps": kv_bytes / sec / 1e12, "rel_err": err})  # fmt: skip
        del k, v
    for r in rows:
        r["speedup_vs_bf16"] = rows[0]["us"] / r["us"]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64x4096,256x2048", help="comma-separated BxCTX decode cases")
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")] if not args.quick else [(2, 48)]
    dev = jax.devices()[0]
    print(f"{getattr(dev, 'device_kind', dev)}  jax {jax.__version__}  {time.strftime('%Y-%m-%d')}")
    print("| case | kv_cache_dtype | time (us) | cache TB/s | speedup vs bf16 | rel err |\n|---|---|---|---|---|---|")
    for b, c in cases:
        for r in run_case(b, c, args.formats.split(","), args.quick):
            print(f"| {r['case']} | {r['kv_cache_dtype']} | {r['us']:.1f} | {r['kv_tbps']:.2f} | "
                  f"{r['speedup_vs_bf16']:.2f}x | {r['rel_err']:.1e} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

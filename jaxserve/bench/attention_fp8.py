"""Decode attention over an fp8 KV cache against a bf16 one (issue 15): same batch, same kernels.

    python -m jaxserve.bench.attention_fp8 [--cases 64x4096,256x2048] [--formats fp8_e4m3,fp8_e5m2] [--quick]
        [--prefill-cases 4x2048]
        [--fp8-decode-compute float16,float16_bits,fp8_dot] [--variant NAME=key=val,key=val ...] [--out rows.json]

Each case is B sequences decoding one token over a context of C tokens (Llama-3-8B attention shapes).
The timed call is the pallas backend's attention without the KV write (``ragged_attention_gpu``) plus
the fp8 path's scale folding, as the engine's step runs it. A prefill case (``--prefill-cases``) times the
whole call, KV write included, over B prompts of CTX new tokens each. Reported: microseconds, the cache bytes read
per second (each sequence's K and V once, in the cache's own dtype), the speedup over bf16 (the goal:
>= 1.7x, half the bytes) and the error against the float32 reference over the same (dequantized) cache.
``--quick`` shrinks the shapes and interprets the kernels: a CPU smoke test.

Kernel variants: each ``--fp8-decode-compute`` value runs over each fp8 format (``GpuKernelConfig``'s option
of that name; the bf16 cache row uses the defaults). Each ``--variant NAME=key=val,...`` overrides other
``GpuKernelConfig`` fields (ints and true/false parsed) and runs over every format, bf16 included, crossed
with the fp8_decode_compute values for the fp8 ones. Speedups are against the default bf16 row of the case.
On Hopper the fp8 rows' default decode kernel is the Mosaic GPU one (``decode_impl=triton`` times the Triton
kernel instead). One more key, ``fp8_v_token_minor=true``, times the fp8 caches with V pages token-minor ``[N, K, D, P]``
(pallas_kernels/kv_layout.py; the bf16 row of such a variant stays token-major, as the engine would keep it).
A table prints as rows finish; a JSON list of all rows prints at the end (and goes to ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.attention import D, H, K, P, rel_err, time_fn
from jaxserve.pallas_kernels import fp8, kv_layout
from jaxserve.pallas_kernels.paged_attention_pallas import (
    FP8_DECODE_COMPUTE,
    GpuKernelConfig,
    paged_attention_pallas,
    ragged_attention_gpu,
)  # fmt: skip
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference


def _attention(q, k, v, md, *, k_scale, v_scale, interpret, config=None, v_token_minor=False):
    """The pallas backend's read path over any cache (fp8: scales folded into q and the output)."""
    if fp8.is_fp8(k.dtype):
        q = fp8.fold_scale(q, k_scale)
    out = ragged_attention_gpu(q, k, v, md, scale=D**-0.5, interpret=interpret, config=config, v_token_minor=v_token_minor)
    return fp8.fold_scale(out, v_scale) if fp8.is_fp8(k.dtype) else out


# A --variant key that is not a GpuKernelConfig field: the fp8 cache's V pages token-minor (kv_layout.py).
V_LAYOUT_KEY = "fp8_v_token_minor"


def _parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=key=val,key=val`` -> (NAME, {key: val}) with GpuKernelConfig field names (or V_LAYOUT_KEY) checked."""
    name, _, body = text.partition("=")
    fields = {f.name for f in dataclasses.fields(GpuKernelConfig)} | {V_LAYOUT_KEY}
    over = {}
    for item in filter(None, body.split(",")):
        key, sep, val = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--variant {text!r}: {item!r} is not key=val with key a GpuKernelConfig field {sorted(fields)}")
        over[key] = int(val) if val.lstrip("-").isdigit() else {"true": True, "false": False}.get(val.lower(), val)
    return name, over


def _configs(name: str, computes: list[str], variants: list[tuple[str, dict]]):
    """(label, fp8_decode_compute or "-", GpuKernelConfig, V token-minor) for one cache format: defaults first.
    The V layout follows kv_layout's rule: token-minor only over an fp8 cache."""
    fmt_computes = computes if name != "auto" else [None]
    for vname, over in [("default", {})] + variants:
        over = dict(over)
        v_minor = bool(over.pop(V_LAYOUT_KEY, False)) and name != "auto"
        for comp in fmt_computes:
            kw = dict(over, **({"fp8_decode_compute": comp} if comp else {}))
            yield vname, comp or "-", GpuKernelConfig(**kw), v_minor


def _prefill(q, k_new, v_new, k, v, md, *, interpret, config, v_token_minor):
    """The pallas backend's whole call, KV write included (its write differs between V layouts)."""
    out, _, _ = paged_attention_pallas(
        q, k_new, v_new, k, v, md, scale=D**-0.5, interpret=interpret, config=config, fp8_v_token_minor=v_token_minor
    )  # fmt: skip
    return out


def _whole_prompt_reference(q, k_new, v_new, num_seqs: int, cache_dtype):
    """Causal attention over whole prompts, one sequence at a time, K/V rounded through the cache's dtype.
    The paged reference gathers a context per query token ([T, C, K, D]: 64 GiB at 4 x 2048), this needs
    one sequence's [H, C, C] scores at a time."""
    t, h, d = q.shape
    kvh = k_new.shape[1]
    k_new, v_new = (fp8.round_trip(x, 1.0, cache_dtype) for x in (k_new, v_new))
    per = lambda x: x.reshape(num_seqs, t // num_seqs, *x.shape[1:]).astype(jnp.float32)  # [S, C, heads, D]

    def one(args):
        qs, ks, vs = args  # [C, H, D], [C, K, D], [C, K, D]
        c = qs.shape[0]
        qg = qs.reshape(c, kvh, h // kvh, d)
        scores = jnp.einsum("qkgd,ckd->kgqc", qg, ks) * d**-0.5
        scores = jnp.where(jnp.tril(jnp.ones((c, c), bool)), scores, -jnp.inf)
        out = jnp.einsum("kgqc,ckd->qkgd", jax.nn.softmax(scores, axis=-1), vs)
        return out.reshape(c, h, d)

    return jax.lax.map(one, (per(q), per(k_new), per(v_new))).reshape(t, h, d)


def run_case(
    num_seqs: int, ctx: int, formats: list[str], quick: bool, computes=("float16",), variants=(), print_row=None,
    prefill: bool = False,
) -> list[dict]:  # fmt: skip
    """Decode (one new token per sequence, attention only) or, with ``prefill``, whole prompts of ``ctx`` tokens
    (KV write and attention; the un-donated cache's copy is timed too, in every row alike)."""
    rng = np.random.default_rng(0)
    batch = make_batch(
        rng, q_lens=[ctx if prefill else 1] * num_seqs, ctx_lens=[ctx] * num_seqs, num_heads=H, num_kv_heads=K,
        head_dim=D, block_size=P, dtype=jnp.bfloat16,
    )  # fmt: skip
    if not prefill:
        batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, decode_only=True))
    rows = []
    for name in ["auto"] + formats:
        dtype = fp8.kv_cache_dtype_for(name, jnp.bfloat16)
        k, v = fp8.quantize(batch.k_pages, 1.0, dtype), fp8.quantize(batch.v_pages, 1.0, dtype)
        with jax.default_matmul_precision("highest"):
            if prefill:
                ref = _whole_prompt_reference(batch.q, batch.k_new, batch.v_new, num_seqs, dtype)
            else:
                ref = ragged_paged_attention_reference(batch.q, k, v, batch.md, scale=D**-0.5)
        v_minor_pages = None
        for vname, comp, cfg, v_minor in _configs(name, list(computes), list(variants)):
            if v_minor and v_minor_pages is None:
                v_minor_pages = jax.block_until_ready(kv_layout.to_token_minor(v))  # [N, K, D, P], made once
            v_in = v_minor_pages if v_minor else v
            kw = {"interpret": quick, "config": cfg, "v_token_minor": v_minor}
            if prefill:
                fn = jax.jit(functools.partial(_prefill, **kw))
                args = (batch.q, batch.k_new, batch.v_new, k, v_in, batch.md)
            else:
                fn = jax.jit(functools.partial(_attention, k_scale=1.0, v_scale=1.0, **kw))
                args = (batch.q, k, v_in, batch.md)
            label = f"{'prefill ' if prefill else ''}B={num_seqs} ctx={ctx}"
            row = {"case": label, "kv_cache_dtype": name, "variant": vname, "fp8_decode_compute": comp}
            try:  # a variant Triton cannot compile is a row with its error, not the end of the run
                row["rel_err"] = float(rel_err(fn(*args), ref))
                sec = time_fn(fn, *args, reps=50, rounds=7)
            except Exception as e:  # noqa: BLE001
                row.update(us=None, kv_tbps=None, speedup_vs_bf16=None, error=f"{type(e).__name__}: {e}"[:400])
            else:
                kv_bytes = 2 * num_seqs * ctx * K * D * dtype.itemsize
                row.update(us=sec * 1e6, kv_tbps=None if prefill else kv_bytes / sec / 1e12)
                row["speedup_vs_bf16"] = rows[0]["us"] / row["us"] if rows and rows[0].get("us") else 1.0
            rows.append(row)
            if print_row:
                print_row(row)
        del k, v, v_minor_pages, args
    return rows


def _print_row(r: dict) -> None:
    head = f"| {r['case']} | {r['kv_cache_dtype']} | {r['variant']} | {r['fp8_decode_compute']} |"
    if r.get("us") is None:
        print(f"{head} FAILED | | | {r['error'][:160]} |", flush=True)
        return
    tbps = "-" if r["kv_tbps"] is None else f"{r['kv_tbps']:.2f}"
    print(f"{head} {r['us']:.1f} | {tbps} | {r['speedup_vs_bf16']:.2f}x | {r['rel_err']:.1e} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64x4096,256x2048", help="comma-separated BxCTX decode cases")
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument(
        "--prefill-cases", default="", help="comma-separated BxCTX prefill cases (whole prompts, KV write included)"
    )  # fmt: skip
    ap.add_argument(
        "--fp8-decode-compute", default="float16",
        help=f"comma-separated GpuKernelConfig.fp8_decode_compute values to time over each fp8 format, of {sorted(FP8_DECODE_COMPUTE)}",
    )  # fmt: skip
    ap.add_argument(
        "--variant", action="append", default=[], metavar="NAME=key=val,...",
        help="GpuKernelConfig overrides timed over every format as well (repeatable), e.g. tail=decode_mask_tail_only=true",
    )  # fmt: skip
    ap.add_argument("--out", help="write the rows as JSON here too")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    args = ap.parse_args(argv)
    computes = args.fp8_decode_compute.split(",")
    for c in computes:
        if c not in FP8_DECODE_COMPUTE:
            raise SystemExit(f"--fp8-decode-compute {c!r}: use values of {sorted(FP8_DECODE_COMPUTE)}")
    variants = [_parse_variant(v) for v in args.variant]
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")] if not args.quick else [(2, 48)]
    dev = jax.devices()[0]
    print(f"{getattr(dev, 'device_kind', dev)}  jax {jax.__version__}  {time.strftime('%Y-%m-%d')}")
    print("| case | kv_cache_dtype | variant | fp8_decode_compute | time (us) | cache TB/s | speedup vs bf16 | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []

    def emit(row):  # --out is rewritten after every row: a run cut short by a time limit keeps its rows
        _print_row(row)
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    prefill_cases = [tuple(int(x) for x in c.split("x")) for c in args.prefill_cases.split(",") if c]
    if args.quick and prefill_cases:
        prefill_cases = [(2, 24)]
    for b, c in cases:
        run_case(b, c, args.formats.split(","), args.quick, computes, variants, print_row=emit)
    for b, c in prefill_cases:
        run_case(b, c, args.formats.split(","), args.quick, computes, variants, print_row=emit, prefill=True)
    print("JSON " + json.dumps(rows))
    return 1 if any(r.get("us") is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

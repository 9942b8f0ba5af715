"""Static sm_90 builds of the pallas backend's Triton kernels for one mixed step, on any machine (no GPU).

    pip install triton
    python -m jaxserve.bench.kernel_sass [--dtypes bfloat16,float32] [--precision highest|tf32]
        [--set key=val,...] [--no-fp32-fma-tiles] [--kv-cache-dtype fp8_e4m3 [--fp8-v-token-minor]]

Lowers the Triton prefill and decode kernels of a step of Llama-3-8B attention shapes (two prompts of 256 new
tokens over 512 of context, two decodes), compiles each with the triton package for sm_90 and reports the
seconds ptxas and Triton took, registers and stack a thread (stack is spilled or local arrays), and the
instruction count: FFMA (float32 FMAs on the CUDA cores) and MMA (tensor-core ops). A kernel that spills
kilobytes a thread is slow to build and slow to run. This is how GpuKernelConfig.fp32_fma_tiles was chosen
(docs/BENCHMARKS.md, §23). The pip Triton's passes are not exactly those jaxlib's Triton runs on a GPU.
Uses jax internals (the Triton lowering), as ``decode_sass`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time

from jaxserve.bench.decode_sass import attention_kernels, compile_cubin, cuobjdump


def parse_overrides(text: str) -> dict:
    """``key=val,...`` into GpuKernelConfig fields (ints, booleans and strings)."""
    from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig

    fields = {f.name for f in dataclasses.fields(GpuKernelConfig)}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, val = item.partition("=")
        if key not in fields or not val:
            raise ValueError(f"--set {item!r}: expected key=value with key one of {sorted(fields)}")
        out[key] = int(val) if val.isdigit() else {"true": True, "false": False}.get(val.lower(), val)
    return out


def step_kernels(dtype: str, precision: str, overrides: dict, kv_cache_dtype: str = "auto",
                 v_token_minor: bool = False) -> tuple[list[str], object]:
    """Triton IR of each kernel of one mixed step computed in ``dtype`` over a ``kv_cache_dtype`` cache (fp8
    pages, V token-minor or not, take the Triton prefill), and the config the kernels ran with."""
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.bench.attention import D, H, K, P
    from jaxserve.pallas_kernels import precision as prec
    from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, kernel_config_for
    from jaxserve.pallas_kernels.random_batch import make_batch

    batch = make_batch(np.random.default_rng(0), q_lens=[256, 256, 1, 1], ctx_lens=[512, 512, 300, 300],
                       num_heads=H, num_kv_heads=K, head_dim=D, block_size=P)  # fmt: skip
    dt = jnp.dtype(dtype)
    p = prec.matmul_precision(dt, precision)
    cfg = GpuKernelConfig(**{"prefill_impl": "triton", "decode_impl": "triton", "decode_splits": 1, **overrides})
    mods = attention_kernels(batch, dtype, kv_cache_dtype, v_token_minor, cfg, p)
    return mods, kernel_config_for(cfg, dt, p)


def build(ttir: str, cfg, out_dir: str) -> dict:
    """Compile one kernel; its name, launch settings, build seconds and resources."""
    name = re.search(r"tt\.func public @(\w+)", ttir).group(1)
    kind = "prefill" if "prefill" in name else "decode" if "decode" in name else "other"
    warps = {"prefill": cfg.prefill_warps, "decode": cfg.decode_warps}.get(kind, 4)
    stages = {"prefill": cfg.prefill_stages, "decode": cfg.decode_stages}.get(kind, 1)
    path = os.path.join(out_dir, name + ".ttir")
    with open(path, "w") as f:
        f.write(ttir)
    t0 = time.perf_counter()
    cubin = compile_cubin(path, warps, stages)
    seconds = time.perf_counter() - t0
    res = cuobjdump("-res-usage", cubin)
    sass = cuobjdump("-sass", cubin)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    return {
        "kernel": kind, "warps": warps, "stages": stages, "build_s": seconds,
        "regs": int(re.search(r"REG:(\d+)", res).group(1)), "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
        "instructions": len(ops), "ffma": sum(op.startswith("FFMA") for op in ops),
        "mma": sum(op.startswith(("HMMA", "HGMMA")) for op in ops),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float32", help="q/KV dtypes, comma-separated")
    ap.add_argument("--precision", default="highest", help="float32 products: highest (IEEE FMAs) or tf32")
    ap.add_argument("--set", dest="overrides", default="", help="GpuKernelConfig overrides, key=val,...")
    ap.add_argument("--no-fp32-fma-tiles", action="store_true", help="keep the bf16-sized tiles for float32 FMAs")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (q's dtype) or an fp8 format, e.g. fp8_e4m3")
    ap.add_argument("--fp8-v-token-minor", action="store_true", help="an fp8 cache's V pages token-minor")
    args = ap.parse_args(argv)
    overrides = parse_overrides(args.overrides)
    if args.no_fp32_fma_tiles:
        overrides["fp32_fma_tiles"] = False
    # A fresh Triton cache: a cached kernel would report no build time.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernel_sass_cache_")
    out_dir = tempfile.mkdtemp(prefix="kernel_sass_")
    print("| dtype | kernel | rows / tile / warps / stages | build s | regs | stack B | instructions | FFMA | MMA |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        mods, cfg = step_kernels(dtype, args.precision, overrides, args.kv_cache_dtype, args.fp8_v_token_minor)
        for ttir in mods:
            r = build(ttir, cfg, out_dir)
            shape = (f"{cfg.prefill_rows} / {cfg.prefill_tile_tokens}" if r["kernel"] == "prefill"
                     else f"- / {cfg.decode_tile_tokens}") + f" / {r['warps']} / {r['stages']}"
            print(f"| {dtype} | {r['kernel']} | {shape} | {r['build_s']:.1f} | {r['regs']} | {r['stack_bytes']} | "
                  f"{r['instructions']} | {r['ffma']} | {r['mma']} |", flush=True)
    print(f"files: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

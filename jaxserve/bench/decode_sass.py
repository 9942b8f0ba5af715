"""Static sm_90 SASS instruction mix of the decode kernel's loops, built on any machine (no GPU needed).

    python -m jaxserve.bench.decode_sass [--formats auto,fp8_e4m3] [--v-layouts major,minor] [--tile 64]
        [--warps 2] [--stages 1] [--set key=val,...] [--keep DIR]

Lowers the pallas backend's decode kernel (Llama-3-8B attention shapes, one new token per sequence) to
Triton IR through jax's Pallas Triton lowering (lowered for "cuda" by ``jax.export``, whose compatibility
check is then expected to refuse the Triton custom call: the IR was captured before that), compiles it
for sm_90 with the ``triton`` pip package and its bundled ptxas, and disassembles it with its cuobjdump.
Each backward branch is a loop; for each one it counts instructions by group. These are static counts,
not timings, and the pip Triton's passes are not exactly those jaxlib's Triton runs on a GPU.

Needs ``pip install triton`` (not a jaxserve dependency). Uses jax internals (the Triton lowering).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

# Instruction groups counted (SASS opcode prefixes): what reshapes data, what converts, what computes.
GROUPS = {
    "PRMT": ("PRMT",),
    "MOV": ("MOV", "IMAD.MOV", "UMOV", "SHFL"),
    "F2FP/cvt": ("F2FP", "F2F", "I2F", "F2I"),
    "HMMA": ("HMMA", "HGMMA"),  # HGMMA: Hopper's warpgroup MMA (wgmma)
    "LDS/STS": ("LDS", "STS", "LDSM", "STSM"),
    "LDG": ("LDG",),
    "BAR": ("BAR",),
}


def lower_decode_ttir(fmt: str, v_minor: bool, tile: int, overrides: dict | None = None) -> str:
    """Triton IR (MLIR text) of the decode kernel over a ``fmt`` cache, captured from the Pallas lowering."""
    import numpy as np

    from jaxserve.bench.attention import D, H, K, P
    from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig
    from jaxserve.pallas_kernels.random_batch import make_batch

    batch = make_batch(np.random.default_rng(0), q_lens=[1] * 4, ctx_lens=[256] * 4, num_heads=H, num_kv_heads=K,
                       head_dim=D, block_size=P)  # fmt: skip
    batch = dataclasses.replace(batch, md=dataclasses.replace(batch.md, decode_only=True))
    # One split: the Triton decode kernel alone (on Hopper an fp8 cache would otherwise take the Mosaic one).
    cfg = GpuKernelConfig(**{"decode_splits": 1, "decode_tile_tokens": tile, "decode_impl": "triton", **(overrides or {})})
    captured = attention_kernels(batch, "bfloat16", fmt, v_minor, cfg)
    if len(captured) != 1:
        raise RuntimeError(f"expected one Triton kernel (the decode kernel), lowered {len(captured)}")
    return captured[0]


def attention_kernels(batch, q_dtype: str, kv_cache_dtype: str, v_token_minor: bool, cfg, precision=None) -> list[str]:
    """Triton IR of every kernel the pallas backend launches for ``batch`` (random_batch.make_batch) with q in
    ``q_dtype`` over a ``kv_cache_dtype`` cache (fp8 pages V token-minor if asked: the engine keeps only fp8
    caches token-minor), lowered for "cuda" on any machine."""
    import jax
    import jax.numpy as jnp

    from jaxserve.bench.attention import D
    from jaxserve.pallas_kernels import fp8, kv_layout
    from jaxserve.pallas_kernels.paged_attention_pallas import ragged_attention_gpu

    dt = jnp.dtype(q_dtype)
    cache = fp8.kv_cache_dtype_for(kv_cache_dtype, dt)
    k, v = fp8.quantize(batch.k_pages, 1.0, cache), fp8.quantize(batch.v_pages, 1.0, cache)
    minor = v_token_minor and fp8.is_fp8(cache)
    if minor:
        v = kv_layout.to_token_minor(v)
    fn = jax.jit(lambda q, k, v, md: ragged_attention_gpu(
        q, k, v, md, scale=D**-0.5, precision=precision, interpret=False, config=cfg, v_token_minor=minor
    ))  # fmt: skip
    return triton_modules(fn, batch.q.astype(dt), k, v, batch.md)


def triton_modules(fn, *args) -> list[str]:
    """The Triton IR (MLIR text) of every Pallas Triton kernel in ``fn(*args)``, lowered for "cuda" on any machine.

    ``jax.export`` lowers for the GPU without one; its compatibility check then refuses the Triton custom
    call, after the lowering this captures. From jax 0.11 the Triton lowering asks for the GPU's compute
    capability and, on a machine without one, finds it only on an abstract mesh's device: the lowering runs
    under a one-device mesh of an abstract H200 (sm_90, the GPU these kernels are tuned for).
    """
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    captured = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = lower(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "gpu"))
    try:
        with use_abstract_mesh(h200):
            jax.export.export(fn, platforms=["cuda"])(*args)
    except ValueError:  # the export's custom-call check, after lowering
        pass
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    return captured


def compile_cubin(ttir_path: str, warps: int, stages: int) -> str:
    """Compile a kernel's Triton IR for sm_90 with the triton package; returns the .cubin's path."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        raise SystemExit("this tool needs the triton package (ptxas and cuobjdump come with it): pip install triton") from None
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    kernel = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cubin = ttir_path.rsplit(".", 1)[0] + ".cubin"
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    return cubin


def cuobjdump(*args: str) -> str:
    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout


def compile_sass(ttir_path: str, warps: int, stages: int) -> str:
    """cuobjdump -sass of the kernel compiled by the triton package for sm_90."""
    return cuobjdump("-sass", compile_cubin(ttir_path, warps, stages))


def loop_mixes(sass: str) -> list[dict]:
    """Per loop (a backward branch's range): total instructions, each group's count, the top opcodes."""
    ins = []  # (address, opcode)
    targets = []  # (branch target, branch address) of backward branches
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?);", line)
        if not m:
            continue
        addr, op = int(m.group(1), 16), m.group(2)
        ins.append((addr, op))
        t = re.search(r"0x([0-9a-f]+)", m.group(3)) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            targets.append((int(t.group(1), 16), addr))
    rows = []
    for lo, hi in targets:
        ops = [op for a, op in ins if lo <= a <= hi]
        row = {"loop": f"{lo:#x}-{hi:#x}", "total": len(ops)}
        for group, prefixes in GROUPS.items():
            row[group] = sum(any(op == p or op.startswith(p + ".") for p in prefixes) for op in ops)
        row["top"] = collections.Counter(ops).most_common(8)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="auto,fp8_e4m3,fp8_e5m2", help="kv_cache_dtype values")
    ap.add_argument("--v-layouts", default="major,minor", help="V pages token-major and/or token-minor (fp8 only)")
    ap.add_argument("--tile", type=int, default=64, help="GpuKernelConfig.decode_tile_tokens")
    ap.add_argument("--warps", type=int, default=2, help="GpuKernelConfig.decode_warps")
    ap.add_argument("--stages", type=int, default=1, help="GpuKernelConfig.decode_stages")
    ap.add_argument("--set", dest="overrides", default="", help="more GpuKernelConfig overrides, key=val,...")
    ap.add_argument("--keep", help="keep the .ttir, .cubin and .sass files in this folder")
    args = ap.parse_args(argv)
    from jaxserve.bench.kernel_sass import parse_overrides  # that module imports this one

    overrides = parse_overrides(args.overrides)
    out_dir = args.keep or tempfile.mkdtemp(prefix="decode_sass_")
    os.makedirs(out_dir, exist_ok=True)
    print("| cache | V layout | loop | total | " + " | ".join(GROUPS) + " |")
    print("|---|---|---|---:|" + "---:|" * len(GROUPS))
    for fmt in args.formats.split(","):
        for layout in args.v_layouts.split(","):
            if layout == "minor" and fmt == "auto":
                continue  # the engine keeps a bf16 cache token-major
            name = f"{fmt}_{layout}"
            ttir = os.path.join(out_dir, name + ".ttir")
            with open(ttir, "w") as f:
                f.write(lower_decode_ttir(fmt, layout == "minor", args.tile, overrides))
            sass = compile_sass(ttir, args.warps, args.stages)
            with open(os.path.join(out_dir, name + ".sass"), "w") as f:
                f.write(sass)
            for row in loop_mixes(sass):
                counts = " | ".join(str(row[g]) for g in GROUPS)
                print(f"| {fmt} | {layout} | {row['loop']} | {row['total']} | {counts} |", flush=True)
    print(f"files: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

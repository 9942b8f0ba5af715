"""The model's own matmuls, timed alone through XLA (and through torch's cuBLAS beside them, when asked).

    python -m jaxserve.bench.matmul_shapes [--shape llama3-8b] [--rows 1,16,256,2048,8192] [--torch] [--device-time DIR] [--out rows.json]

Why: the engine's steps are mostly matmuls (a decode step of 256 sequences spends ~6 of its 15 ms in them,
a prefill step of 2,048 tokens nearly all of its time), so how fast XLA runs each projection's shape, and
how that compares with the same shape through cuBLAS directly, says how much of the offline workload's gap to
its roofline the matmuls hold. ``XLA_FLAGS`` set for the process is recorded with the rows, so flag variants
(e.g. ``--xla_gpu_enable_triton_gemm=false``) are timed by running the bench once per setting.

Each (projection, rows) pair runs R products over R distinct weight copies (more bytes than the L2 cache, as a
step's layers have), inside one jitted call, several calls back to back: per product, the call's time / R.
bf16 operands and output, float32 accumulation, as ``models.layers.Linear`` runs them. The wall clock times
products under ~20 µs by the host's launches, not the device: ``--device-time DIR`` takes the device's busy
time from a profiler trace instead. torch's products run from a replayed CUDA graph, timed by CUDA events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from jaxserve.bench.model_shapes import SHAPES


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of a Llama-family decoder's matmuls (q/k/v and gate/up fused, as jaxserve runs them)."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or d // h
    return {
        "qkv": (d, (h + 2 * kv) * dh),
        "o": (h * dh, d),
        "gate_up": (d, 2 * f),
        "down": (f, d),
        "lm_head": (d, cfg["vocab_size"]),
    }


def _copies(k: int, n: int, itemsize: int = 2, l2_bytes: int = 2 << 30) -> int:
    """How many weight copies one call cycles through: past the L2 cache by far, at most 2 GiB in all."""
    return max(4, min(32, l2_bytes // (k * n * itemsize)))


def time_jax(m: int, k: int, n: int, calls: int = 5, trace_dir: str | None = None) -> float:
    """Seconds per product of [m, k] x [k, n] in bf16 through a jitted call of R products. With ``trace_dir`` the
    device's busy time from a profiler trace instead of the wall clock: small products finish faster than the
    host launches them, and the wall clock then times the host."""
    import jax
    import jax.numpy as jnp

    r = _copies(k, n)
    keys = jax.random.split(jax.random.key(0), 2 * r)
    xs = [jax.random.normal(keys[i], (m, k), jnp.bfloat16) for i in range(r)]
    ws = [jax.random.normal(keys[r + i], (k, n), jnp.bfloat16) * 0.02 for i in range(r)]
    f = jax.jit(lambda xs, ws: [jnp.dot(x, w) for x, w in zip(xs, ws)])
    jax.block_until_ready(f(xs, ws))  # compile + warm up
    jax.block_until_ready(f(xs, ws))
    if trace_dir is not None:
        from jaxserve.bench import trace

        out_dir = os.path.join(trace_dir, f"m{m}-k{k}-n{n}")
        with trace.capture(out_dir):
            jax.block_until_ready([f(xs, ws) for _ in range(calls)])
        devices = trace.summarize(out_dir).devices
        if not devices:
            raise RuntimeError("the trace holds no device events (a CPU run): drop --device-time")
        return sum(d["busy_ms"] for d in devices.values()) / 1e3 / (calls * r)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [f(xs, ws) for _ in range(calls)]  # back to back: dispatch overlaps the device's work
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / (calls * r))
    return statistics.median(times)


def time_torch(m: int, k: int, n: int, calls: int = 5) -> float | None:
    """The same through torch (cuBLAS) in a replayed CUDA graph, timed with CUDA events; None without a CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    r = _copies(k, n)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(r)]
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(r)]
    # Captured once in a CUDA graph and replayed: the products then run back to back, not at the host's pace.
    for x, w in zip(xs, ws):
        x @ w
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [x @ w for x, w in zip(xs, ws)]
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / (calls * r))
    del xs, ws, outs, graph
    torch.cuda.empty_cache()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.bench.matmul_shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="a model shape of model_shapes")
    ap.add_argument("--rows", default="1,16,256,2048,8192", help="comma-separated row counts (tokens in a step)")
    ap.add_argument("--only", default="", help="comma-separated projections to time (default: all)")
    ap.add_argument("--torch", action="store_true", help="time each shape through torch's cuBLAS too")
    ap.add_argument("--device-time", metavar="DIR", help="time XLA's products by the device's busy time in profiler "
                    "traces written under DIR (GPU), not the wall clock, which times the host for small products")
    ap.add_argument("--out", help="write the rows as JSON here")
    ns = ap.parse_args(argv)
    cfg = SHAPES[ns.shape]
    projs = projections(cfg)
    if ns.only:
        unknown = set(ns.only.split(",")) - set(projs)
        if unknown:
            ap.error(f"--only {ns.only!r}: unknown {sorted(unknown)}; use names of {sorted(projs)}")
        projs = {k: v for k, v in projs.items() if k in ns.only.split(",")}
    rows_list = [int(x) for x in ns.rows.split(",") if x]
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"XLA_FLAGS={flags!r}", flush=True)
    print(f"{'proj':8} {'M':>5} {'K':>6} {'N':>7} {'xla us':>9} {'TFLOP/s':>8} {'w TB/s':>7}"
          + (f" {'torch us':>9} {'TFLOP/s':>8} {'xla speed':>9}" if ns.torch else ""), flush=True)  # fmt: skip
    rows = []
    for name, (k, n) in projs.items():
        for m in rows_list:
            t = time_jax(m, k, n, trace_dir=ns.device_time)
            flop, wbytes = 2 * m * k * n, 2 * k * n
            row = dict(proj=name, m=m, k=k, n=n, xla_s=t, xla_tflops=flop / t / 1e12, weight_tbps=wbytes / t / 1e12,
                       xla_flags=flags, timer="device" if ns.device_time else "wall")  # fmt: skip
            line = f"{name:8} {m:5d} {k:6d} {n:7d} {t * 1e6:9.1f} {row['xla_tflops']:8.1f} {row['weight_tbps']:7.2f}"
            if ns.torch:
                tt = time_torch(m, k, n)
                if tt is not None:
                    row.update(torch_s=tt, torch_tflops=flop / tt / 1e12)
                    line += f" {tt * 1e6:9.1f} {row['torch_tflops']:8.1f} {tt / t:9.2f}"
            rows.append(row)
            print(line, flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

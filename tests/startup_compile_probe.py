"""Where an engine's start-up goes (not a test: a measuring script, for a GPU).

    python tests/startup_compile_probe.py MODEL DTYPE PRECOMPILE [NUM_PROMPTS]
    python tests/startup_compile_probe.py fp32-gemm [torch]

The first form builds LLM(MODEL, load_format="dummy", dtype=DTYPE, precompile=PRECOMPILE) with JAX's
persistent cache off, counts XLA's backend compiles and their seconds through ``jax.monitoring`` (summed: they
overlap when shapes compile side by side), then times NUM_PROMPTS (64) x 512 -> 32 twice, with the compiles
each run triggered. The second times one float32 4096 x 4096 x 14336 matmul at HIGHEST precision through XLA
(whatever XLA_FLAGS says), or through torch with TF32 off. docs/BENCHMARKS.md §22 has its numbers.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time


def gemm(which: str) -> None:
    import numpy as np

    m, k, n = 4096, 4096, 14336  # a prefill chunk against the 8B's MLP up-projection
    if which == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
    else:
        import jax
        import jax.numpy as jnp

        f = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
        f(a, b).block_until_ready()
        t = time.perf_counter()
        for _ in range(20):
            r = f(a, b)
        r.block_until_ready()
        ref = np.asarray(a[:64], np.float64) @ np.asarray(b, np.float64)
        print("rel err vs float64", float(np.linalg.norm(np.asarray(r[:64]) - ref) / np.linalg.norm(ref)))
    dt = (time.perf_counter() - t) / 20
    print(json.dumps({"which": which, "xla_flags": os.environ.get("XLA_FLAGS", ""), "ms": dt * 1e3,
                      "tflops": 2 * m * k * n / dt / 1e12}))


def startup(model: str, dtype: str, precompile: str, n: int) -> None:
    import jax.monitoring as mon

    events = collections.defaultdict(list)
    mon.register_event_duration_secs_listener(lambda ev, dur, *a, **k: events[ev].append(dur))

    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    tag = f"[{dtype} precompile={precompile}]"
    t = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", dtype=dtype, max_model_len=1024, precompile=precompile,
              compilation_cache_dir="")
    start = time.perf_counter() - t
    comp = events["/jax/core/compile/backend_compile_duration"]
    print(f"{tag} start {start:.1f} s; backend compiles {len(comp)} taking {sum(comp):.1f} s; "
          f"slowest {[round(d, 1) for d in sorted(comp, reverse=True)[:6]]}", flush=True)
    runner = llm.llm_engine.runner
    slowest = sorted(runner.compile_seconds.items(), key=lambda kv: -kv[1])[:6]
    print(f"{tag} slowest step shapes (tokens, ctx, decode-only: wall s): "
          + ", ".join(f"({t}, {b * runner.block_size}, {d}): {sec:.1f}" for (t, b, d), sec in slowest), flush=True)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    for r, label in enumerate(("first", "second")):
        ids = [[100 + (i * 7 + j * (r + 3)) % 30000 for j in range(512)] for i in range(n)]  # no prefix-cache hits
        k0, t = len(comp), time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
        el = time.perf_counter() - t
        print(f"{tag} {label} run {n} x 512 -> 32: {el:.2f} s, {n * 32 / el:.0f} out tok/s, "
              f"{len(comp) - k0} compiles taking {sum(comp[k0:]):.1f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "fp32-gemm":
        gemm(sys.argv[2] if len(sys.argv) > 2 else "jax")
    else:
        startup(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 64)

"""Attention kernel benchmark: jaxserve's Pallas kernels against XLA (the jnp reference) and jax's bundled ops.

    python -m jaxserve.bench.attention [--out results.json] [--quick]
        [--decode-configs a,b] [--prefill-configs a,b] [--prefill-impl auto|mosaic|triton] [--skip-decode]

Decode is memory-bound, so it is scored in KV bytes read per second (each sequence's K and V context
read once); prefill in causal attention TFLOP/s (4*H*D per visible query-key pair). The ceilings are
measured in the same run: an elementwise copy for HBM bandwidth (bytes read + written) and a bf16
8192^3 matmul for the tensor-core rate. Every timed variant is first checked against the reference.
Decode is also compared with jax's bundled Pallas ``paged_attention``; prefill with jax's bundled
Mosaic GPU flash attention run on already-gathered contiguous K/V (no paging: a ceiling of sorts).
``--quick`` shrinks every shape and runs the kernels in interpret mode: a smoke test for CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.paged_attention_pallas import GpuKernelConfig, paged_attention_pallas, ragged_attention_gpu
from jaxserve.pallas_kernels.random_batch import make_batch
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference

H, K, D, P = 32, 8, 128, 16  # Llama-3-8B attention, block size 16


def time_fn(fn: Callable, *args, reps: int = 20, rounds: int = 5) -> float:
    """Median seconds per call: `reps` calls back to back, one sync per round, so launch gaps overlap."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def time_donating(fn: Callable, k, v, *rest, reps: int, rounds: int) -> float:
    """``time_fn`` for ``fn(k, v, *rest) -> (..., k, v)`` that donates the KV cache (in place, as in the
    engine's step): each call takes the cache the previous call returned."""
    cache = [k, v]

    def call():
        *_, cache[0], cache[1] = fn(*cache, *rest)
        return cache

    return time_fn(call, reps=reps, rounds=rounds)


def kv_write_rows(batch, cfg: GpuKernelConfig, scale: float, quick: bool, reps: int, rounds: int) -> dict:
    """The KV write in context: the whole attention call (write + kernels) as the engine's step runs it,
    with the Pallas row-copy write and with XLA's scatter. Minus the kernels' time alone (the
    ``jaxserve_pallas[default]`` row), that is the write's cost, and the most that fusing it into the
    kernels could save. (A write timed on its own is mostly dispatch for a decode step's few rows.)"""
    rows = {}
    for impl in ("pallas", "xla"):
        c = dataclasses.replace(cfg, kv_write=impl)
        whole = jax.jit(
            lambda k, v, q, kn, vn, md, c=c: paged_attention_pallas(q, kn, vn, k, v, md, scale=scale, config=c, interpret=quick),
            donate_argnums=(0, 1),
        )
        k, v = jnp.copy(batch.k_pages), jnp.copy(batch.v_pages)  # fresh copies: the calls donate them
        sec = time_donating(whole, k, v, batch.q, batch.k_new, batch.v_new, batch.md, reps=reps, rounds=rounds)
        name = f"jaxserve_pallas_with_kv_write[{impl}]"
        rows[name] = {"us": sec * 1e6}
        print(f"  {name:48s} {sec * 1e6:9.1f} us", flush=True)
    return rows


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def ceilings(quick: bool) -> dict:
    n = 1 << (20 if quick else 30)  # 2 GiB of bf16
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy_s = time_fn(jax.jit(lambda a: a + 1), x, reps=10)
    m = 512 if quick else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm_s = time_fn(jax.jit(jnp.dot), a, b, reps=10)
    return {"hbm_copy_tbps": 2 * n * 2 / copy_s / 1e12, "bf16_matmul_tflops": 2 * m**3 / mm_s / 1e12}


def bundled_paged_attention(batch, interpret: bool):
    """jax's own GPU Pallas paged_attention wants [K, N, P, D] pages and per-sequence [H, D] queries."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    k_t = jnp.transpose(batch.k_pages, (2, 0, 1, 3))  # [K, N, P, D], built once outside the timing
    v_t = jnp.transpose(batch.v_pages, (2, 0, 1, 3))
    width = batch.md.block_tables.shape[1]
    splits = max(s for s in (16, 8, 4, 2, 1) if width % s == 0)
    fn = jax.jit(lambda q, k, v, bt, ln: paged_attention(q * D**-0.5, k, v, bt, ln, k_splits=splits, interpret=interpret))
    return fn, (batch.q, k_t, v_t, batch.md.block_tables, batch.md.seq_lens)


def decode_case(rng, num_seqs: int, ctx: int, configs: dict, quick: bool) -> dict:
    batch = make_batch(
        rng, q_lens=[1] * num_seqs, ctx_lens=[ctx] * num_seqs, num_heads=H, num_kv_heads=K, head_dim=D, block_size=P
    )
    kv_bytes = 2 * num_seqs * ctx * K * D * batch.k_pages.dtype.itemsize
    scale = D**-0.5
    args = (batch.q, batch.k_pages, batch.v_pages, batch.md)
    ref_fn = jax.jit(lambda q, k, v, md: ragged_paged_attention_reference(q, k, v, md, scale=scale))
    ref = ref_fn(*args)
    rows = {}

    def record(name, fn, fn_args, out=None):
        err = rel_err(out if out is not None else fn(*fn_args), ref)
        sec = time_fn(fn, *fn_args, reps=50, rounds=7)
        rows[name] = {"us": sec * 1e6, "kv_tbps": kv_bytes / sec / 1e12, "rel_err": err}
        print(f"  decode S={num_seqs} ctx={ctx} {name:40s} {sec * 1e6:9.1f} us {kv_bytes / sec / 1e12:6.3f} TB/s err {err:.1e}", flush=True)

    record("xla_reference", ref_fn, args, out=ref)
    fn, b_args = bundled_paged_attention(batch, interpret=quick)
    record("jax_bundled_pallas", fn, b_args)
    for name, cfg in configs.items():
        try:
            ours = jax.jit(lambda q, k, v, md, cfg=cfg: ragged_attention_gpu(q, k, v, md, scale=scale, config=cfg, interpret=quick))
            record(f"jaxserve_pallas[{name}]", ours, args)
        except Exception as e:  # a config the compiler rejects (e.g. shared memory) is reported, not fatal
            rows[f"jaxserve_pallas[{name}]"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    best = _best(rows, "kv_tbps", prefix="jaxserve")
    if best is not None and not quick:
        # How much of the entry point's time is the decode kernel itself (the rest: pad, merge, routing).
        cfg = configs[best[len("jaxserve_pallas["):-1]]
        only = jax.jit(lambda q, k, v, md, cfg=cfg: _decode_kernel_only(q, k, v, md, cfg))
        sec = time_fn(only, *args, reps=50, rounds=7)
        rows[f"decode_kernel_only[{best}]"] = {"us": sec * 1e6, "kv_tbps": kv_bytes / sec / 1e12, "rel_err": float("nan")}
        print(f"  decode kernel alone ({best}): {sec * 1e6:.1f} us {kv_bytes / sec / 1e12:.3f} TB/s", flush=True)
    if "default" in configs:
        rows.update(kv_write_rows(batch, configs["default"], scale, quick, reps=50, rounds=7))
    return {"num_seqs": num_seqs, "ctx": ctx, "kv_bytes": kv_bytes, "results": rows}


def _decode_kernel_only(q, k_pages, v_pages, md, cfg):
    """The decode kernel (and its split merge, when it splits) without the entry point's routing."""
    from jaxserve.pallas_kernels import triton_common as tc
    from jaxserve.pallas_kernels.paged_attention_pallas import _decode_splits
    from jaxserve.pallas_kernels.triton_decode import decode_attention

    t, h, d = q.shape
    kh, gp = k_pages.shape[2], h // k_pages.shape[2]
    q_per_seq = max(1, 16 // gp)
    q_p = jnp.pad(q.reshape(t, kh, gp, d), ((0, q_per_seq), (0, 0), (0, 0), (0, 0)))
    tile = tc.pick_tile_tokens(cfg.decode_tile_tokens, d, q.dtype.itemsize, cfg.decode_stages)
    s_count, width = md.block_tables.shape
    splits = cfg.decode_splits or _decode_splits(s_count, kh, -(-width * k_pages.shape[1] // tile))
    return decode_attention(
        q_p, k_pages, v_pages, md.query_start_loc, md.seq_lens, md.block_tables, scale=d**-0.5,
        q_per_seq=q_per_seq, tile_tokens=tile, num_splits=splits, sliding_window=None, v_mask=cfg.v_mask,
        num_warps=cfg.decode_warps, num_stages=cfg.decode_stages, heads_inner=cfg.decode_heads_inner,
        interpret=False,
    )  # fmt: skip


def dense_causal_prefill(q, k_pages, v_pages, block_tables, *, scale):
    """XLA baseline for a batch of whole prompts of equal length L (T = S * L): gather, then dense causal attention."""
    s_count = block_tables.shape[0]
    t, h, d = q.shape
    length, kh = t // s_count, k_pages.shape[2]
    k = k_pages[block_tables].reshape(s_count, -1, kh, d)[:, :length]  # [S, L, K, D]
    v = v_pages[block_tables].reshape(s_count, -1, kh, d)[:, :length]
    qg = q.reshape(s_count, length, kh, h // kh, d)  # [S, L, K, G, D]
    scores = jnp.einsum("slkgd,sckd->skglc", qg, k, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((length, length), bool))  # [L, C]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)  # [S, K, G, L, C]
    out = jnp.einsum("skglc,sckd->slkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(t, h, d).astype(q.dtype)


def bundled_flash_mgpu(batch, num_seqs: int, prompt: int, scale: float):
    """jax's bundled Mosaic GPU (FlashAttention-3 style) kernel wants [B, L, H, D], contiguous K/V, float16."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    t, h, d = batch.q.shape
    kh = batch.k_pages.shape[2]
    # It applies no softmax scale, and its shared-memory buffers are float16.
    q = (batch.q * scale).reshape(num_seqs, prompt, h, d).astype(jnp.float16)
    k = batch.k_pages[batch.md.block_tables].reshape(num_seqs, -1, kh, d)[:, :prompt].astype(jnp.float16)
    v = batch.v_pages[batch.md.block_tables].reshape(num_seqs, -1, kh, d)[:, :prompt].astype(jnp.float16)
    cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, cfg)), (q, k, v)


def prefill_case(rng, num_seqs: int, prompt: int, configs: dict, quick: bool) -> dict:
    batch = make_batch(
        rng, q_lens=[prompt] * num_seqs, ctx_lens=[prompt] * num_seqs, num_heads=H, num_kv_heads=K, head_dim=D, block_size=P
    )
    flops = 4 * H * D * num_seqs * prompt * (prompt + 1) / 2
    scale = D**-0.5
    args = (batch.q, batch.k_pages, batch.v_pages, batch.md)
    xla_fn = jax.jit(lambda q, k, v, bt: dense_causal_prefill(q, k, v, bt, scale=scale))
    ref = xla_fn(batch.q, batch.k_pages, batch.v_pages, batch.md.block_tables)
    # The gather reference (T x C x K x D floats) does not fit at this size; check the dense one against it
    # on two short prompts instead.
    small = make_batch(
        np.random.default_rng(1), q_lens=[40] * 2, ctx_lens=[40] * 2, num_heads=H, num_kv_heads=K, head_dim=D, block_size=P
    )
    dense_err = rel_err(
        dense_causal_prefill(small.q, small.k_pages, small.v_pages, small.md.block_tables, scale=scale),
        ragged_paged_attention_reference(small.q, small.k_pages, small.v_pages, small.md, scale=scale),
    )
    rows = {}
    sec = time_fn(xla_fn, batch.q, batch.k_pages, batch.v_pages, batch.md.block_tables, reps=3, rounds=3)
    rows["xla_dense_causal"] = {"us": sec * 1e6, "tflops": flops / sec / 1e12, "rel_err": dense_err}
    print(f"  prefill {num_seqs}x{prompt} xla_dense_causal {sec * 1e6:9.1f} us {flops / sec / 1e12:6.1f} TFLOP/s (vs gather ref {dense_err:.1e})", flush=True)
    if not quick:
        try:  # jax's own Mosaic GPU flash attention, on contiguous (already gathered) K/V: no paging
            fn, b_args = bundled_flash_mgpu(batch, num_seqs, prompt, scale)
            err = rel_err(fn(*b_args).reshape(ref.shape), ref)
            sec = time_fn(fn, *b_args, reps=5)
            rows["jax_bundled_mgpu_flash_contiguous"] = {"us": sec * 1e6, "tflops": flops / sec / 1e12, "rel_err": err}
            print(f"  prefill {num_seqs}x{prompt} jax_bundled_mgpu_flash_contiguous {sec * 1e6:9.1f} us {flops / sec / 1e12:6.1f} TFLOP/s err {err:.1e}", flush=True)
        except Exception as e:
            rows["jax_bundled_mgpu_flash_contiguous"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  jax_bundled_mgpu_flash_contiguous: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for name, cfg in configs.items():
        try:
            ours = jax.jit(lambda q, k, v, md, cfg=cfg: ragged_attention_gpu(q, k, v, md, scale=scale, config=cfg, interpret=quick))
            err = rel_err(ours(*args), ref)
            sec = time_fn(ours, *args, reps=5)
            rows[f"jaxserve_pallas[{name}]"] = {"us": sec * 1e6, "tflops": flops / sec / 1e12, "rel_err": err}
            print(f"  prefill {num_seqs}x{prompt} {name:40s} {sec * 1e6:9.1f} us {flops / sec / 1e12:6.1f} TFLOP/s err {err:.1e}", flush=True)
        except Exception as e:
            rows[f"jaxserve_pallas[{name}]"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if "default" in configs:
        rows.update(kv_write_rows(batch, configs["default"], scale, quick, reps=5, rounds=5))
    return {"num_seqs": num_seqs, "prompt": prompt, "flops": flops, "results": rows}


def decode_configs(quick: bool) -> dict:
    """The default plus its neighbours (a wider sweep of tiles, warps, stages and masking ran earlier:
    docs/BENCHMARKS.md, section 3)."""
    out = {"default": GpuKernelConfig()}
    if quick:
        return out
    out["seq_major_grid"] = GpuKernelConfig(decode_heads_inner=False)  # the grid order before 2026-11-29
    out["triton_prefill"] = GpuKernelConfig(prefill_impl="triton")  # routing pass instead of one shared buffer
    out["tile64_w2_s2"] = GpuKernelConfig(decode_stages=2)  # the default before 2026-11-29
    out["tile64_w2_s3"] = GpuKernelConfig(decode_stages=3)
    out["tile32_w2_s1"] = GpuKernelConfig(decode_tile_tokens=32)
    out["tile128_w2_s1"] = GpuKernelConfig(decode_tile_tokens=128)
    out["tile64_w4_s1"] = GpuKernelConfig(decode_warps=4)
    for splits in (1, 2, 4):
        out[f"splits{splits}"] = GpuKernelConfig(decode_splits=splits)
    out["v_mask_none"] = GpuKernelConfig(v_mask="none")
    return out


def prefill_configs(quick: bool) -> dict:
    if quick:
        return {"default": GpuKernelConfig(), "triton": GpuKernelConfig(prefill_impl="triton")}
    out = {"default": GpuKernelConfig(), "triton": GpuKernelConfig(prefill_impl="triton")}
    for bkv, stages in ((128, 2), (64, 2), (64, 3), (64, 4)):
        out[f"mosaic_kv{bkv}_s{stages}"] = GpuKernelConfig(prefill_impl="mosaic", mosaic_block_kv=bkv, mosaic_stages=stages)
    # Ping-pong schedule between the compute warpgroups, Q from registers or shared memory.
    for pp, qs in ((True, False), (True, True), (False, True)):
        name = "mosaic" + ("_pingpong" if pp else "") + ("_qsmem" if qs else "")
        out[name] = GpuKernelConfig(prefill_impl="mosaic", mosaic_pingpong=pp, mosaic_q_smem=qs)
    out["mosaic_pingpong_qsmem_kv64_s3"] = GpuKernelConfig(
        prefill_impl="mosaic", mosaic_pingpong=True, mosaic_q_smem=True, mosaic_block_kv=64, mosaic_stages=3
    )
    for rows, tile, warps, stages in ((128, 64, 4, 3), (128, 128, 8, 2)):
        out[f"triton_rows{rows}_tile{tile}_w{warps}_s{stages}"] = GpuKernelConfig(
            prefill_impl="triton", prefill_rows=rows, prefill_tile_tokens=tile, prefill_warps=warps, prefill_stages=stages
        )
    return out


def _select(configs: dict, names: str | None) -> dict:
    """Keep the configs named in a comma-separated list (all when None); "default" always stays."""
    if not names:
        return configs
    keep = {"default", *names.split(",")}
    unknown = keep - set(configs)
    if unknown:
        raise SystemExit(f"unknown config(s) {sorted(unknown)}; known: {sorted(configs)}")
    return {n: c for n, c in configs.items() if n in keep}


def _force_impl(configs: dict, impl: str | None) -> dict:
    if impl is None:
        return configs
    return {n: dataclasses.replace(c, prefill_impl=impl) for n, c in configs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the full results as JSON here")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--decode-configs", default=None, help="comma-separated subset of the decode configs")
    ap.add_argument("--prefill-configs", default=None, help="comma-separated subset of the prefill configs")
    ap.add_argument("--prefill-impl", default=None, choices=("auto", "mosaic", "triton"), help="force it in every config")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    res = {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    cases = [(64, 2048), (256, 1024)] if not args.quick else [(4, 40)]
    if not args.skip_decode:
        dec_cfgs = _force_impl(_select(decode_configs(args.quick), args.decode_configs), args.prefill_impl)
        res["decode"] = [decode_case(rng, s, c, dec_cfgs, args.quick) for s, c in cases]
    if not args.skip_prefill:
        s, p = (8, 2048) if not args.quick else (2, 40)
        pre_cfgs = _force_impl(_select(prefill_configs(args.quick), args.prefill_configs), args.prefill_impl)
        res["prefill"] = [prefill_case(rng, s, p, pre_cfgs, args.quick)]
    # Ceilings last, on a warm GPU (clocks idle low before the first kernels).
    res["ceilings"] = ceilings(args.quick)
    print(f"ceilings: {res['ceilings']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print_table(res)
    return 0


def print_table(res: dict) -> None:
    c = res["ceilings"]
    print(f"\n{res['device']}  jax {res['jax']}  copy {c['hbm_copy_tbps']:.2f} TB/s  matmul {c['bf16_matmul_tflops']:.0f} TFLOP/s")
    print("| case | variant | time (us) | rate | rel err |\n|---|---|---|---|---|")
    for case in res.get("decode", []):
        best = _best(case["results"], "kv_tbps", prefix="jaxserve")
        for name, r in case["results"].items():
            if "error" in r or (name.startswith("jaxserve_pallas[") and name not in (best, "jaxserve_pallas[default]")):
                continue
            if "kv_tbps" not in r:  # the KV-write rows: times only
                print(f"| decode S={case['num_seqs']} ctx={case['ctx']} | {name} | {r['us']:.1f} | - | - |")
                continue
            if name.startswith("decode_kernel_only"):
                print(f"| decode S={case['num_seqs']} ctx={case['ctx']} | {name} | {r['us']:.1f} | {r['kv_tbps']:.2f} TB/s | - |")
                continue
            print(f"| decode S={case['num_seqs']} ctx={case['ctx']} | {name} | {r['us']:.1f} | {r['kv_tbps']:.2f} TB/s | {r['rel_err']:.1e} |")
    for case in res.get("prefill", []):
        best = _best(case["results"], "tflops", prefix="jaxserve")
        for name, r in case["results"].items():
            if "error" not in r and "tflops" not in r:  # the KV-write rows: times only
                print(f"| prefill {case['num_seqs']}x{case['prompt']} | {name} | {r['us']:.1f} | - | - |")
            elif name in (best, "jaxserve_pallas[default]", "jaxserve_pallas[triton]", "xla_dense_causal", "jax_bundled_mgpu_flash_contiguous") and "error" not in r:
                print(f"| prefill {case['num_seqs']}x{case['prompt']} | {name} | {r['us']:.1f} | {r['tflops']:.1f} TFLOP/s | {r['rel_err']:.1e} |")


def _best(results: dict, key: str, prefix: str) -> str | None:
    ok = {n: r[key] for n, r in results.items() if n.startswith(prefix) and key in r}
    return max(ok, key=ok.get) if ok else None


if __name__ == "__main__":
    sys.exit(main())

"""`jaxserve bench throughput`: offline output tokens/s and requests/s, optionally beside HF transformers.

With --compare-hf the same prompts run through transformers' `generate` in static batches (EOS ignored,
each batch padded on the left and run to its longest requested output) in a subprocess of the same job,
and the ratio of asked-for output tokens per second is reported (HF runs in the engine's dtype).

--roofline adds the workload's roofline (jaxserve.bench.roofline.offline: model FLOPs at a matmul rate and
bytes at a copy rate, both measured in this job before the engine is built) and the fraction reached.
--single-stream also runs `bench latency`'s measurement on the same engine (one engine start, not two).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time

from jaxserve.bench.latency import add_single_stream_args


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("throughput", help="offline throughput (output tokens/s, requests/s)")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=64)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=64)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.5,
                   help="lengths vary uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--dataset", default=None, help='JSON list of {"prompt": str, "output_len": int}')
    p.add_argument("--compare-hf", "--compare_hf", dest="compare_hf", action="store_true",
                   help="also run HF transformers generate (static batches) on the same prompts (needs torch)")
    p.add_argument("--hf-batch-size", "--hf_batch_size", dest="hf_batch_size", type=int, default=16)
    p.add_argument("--roofline", action="store_true",
                   help="measure the matmul and copy rates and report the workload's roofline and the fraction reached")
    p.add_argument("--single-stream", "--single_stream", dest="single_stream", action="store_true",
                   help="also measure single-stream decode (as `bench latency`) on the same engine")
    add_single_stream_args(p, prefix="single-stream")
    p.add_argument("--quick", action="store_true", help="small roofline measurements (smoke runs, CPU tests)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    p.add_argument("--trace-dir", default=None,
                   help="after the timed run, run the workload once more with a window of its steps traced by the "
                        "JAX profiler into this directory, and print where their time went (jaxserve.bench.trace)")
    p.add_argument("--trace-steps", default="50:20", help="the traced window, FIRST:COUNT engine steps (default 50:20)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench import latency, roofline, step_timeline, trace
    from jaxserve.bench.hf_generate import run_in_subprocess
    from jaxserve.bench.workload import dataset_workload, random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    window = trace.parse_window(ns.trace_steps) if ns.trace_dir else None  # checked before any work
    args = engine_args_from(ns)
    path, cfg = latency.model_path_and_config(args)
    if ns.dataset:
        from jaxserve.model_loader import load_tokenizer

        work = dataset_workload(ns.dataset, load_tokenizer(path, args.tokenizer), ns.output_len)
    else:
        # Stay clear of special tokens at the top of small vocabularies.
        work = random_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, cfg.vocab_size, seed=0,
                               token_range=(100, min(cfg.vocab_size, 32000)))
    dtype = latency.resolve_dtype(args.dtype)
    # HF first, each run in a process of its own, while no JAX process holds the device's memory.
    hf = run_in_subprocess(path, work, ns.hf_batch_size, dtype) if ns.compare_hf else None
    if ns.single_stream:
        single_work, single_hf = latency.prepare(ns, "single_stream_", path, cfg, dtype)
    # Measured before the engine exists: its KV cache takes most of the device memory.
    rates = roofline.measure_rates(dtype, quick=ns.quick) if ns.roofline or ns.single_stream else None
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]

    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm the host paths; shapes are precompiled
    with step_timeline.record(engine) as steps:  # a few microseconds a step: the timed run keeps it
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(w.prompt_token_ids) for w in work)
    result = {
        "engine": "jaxserve",
        "model": engine.model_config.served_model_name,
        "num_prompts": len(work),
        # The workload's flags (a --dataset run has none); `bench ablation --reuse` checks them.
        "workload": None if ns.dataset else dict(num_prompts=ns.num_prompts, input_len=ns.input_len,
                                                 output_len=ns.output_len, range_ratio=ns.range_ratio),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(work) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "startup_s": startup_s,
        # Cumulative, warm-up included (2 short requests, which never preempt).
        "num_preemptions": getattr(engine.get_stats(), "num_preemptions", None) if hasattr(engine, "get_stats") else None,
        "engine_info": engine.info(),
        "engine_args": dataclasses.asdict(args),
        # A data-parallel router has not started JAX on the devices (its replicas hold them): ask them.
        "device": engine.info().get("device_kind") or str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        # Per group of consecutive steps: wall, host and wait ms (step_timeline); empty for a DP router.
        "step_timeline": step_timeline.summarize(steps),
        "step_times": step_timeline.per_step(steps),  # each step: [wall ms, wait ms, tokens, running]
    }
    if steps:
        print(step_timeline.format_summary(result["step_timeline"]))
    print(
        f"jaxserve: {len(work)} requests in {elapsed:.2f}s: {result['requests_per_s']:.2f} req/s, "
        f"{result['output_tokens_per_s']:.1f} output tok/s, {result['total_tokens_per_s']:.1f} total tok/s, "
        f"{result['num_preemptions']} preemptions, {result['engine_info'].get('num_kv_blocks')} KV blocks"
    )
    if ns.roofline:
        sc = engine.scheduler_config
        roof = roofline.offline(engine.text_config, dtype, work, sc.max_num_seqs, sc.max_num_batched_tokens, rates)
        result["roofline"] = roof
        result["roofline_fraction"] = result["output_tokens_per_s"] / roof["output_tokens_per_s"]
        result["serial_roofline_fraction"] = result["output_tokens_per_s"] / roof["serial_output_tokens_per_s"]
        print(f"roofline ({roofline.format_rates(rates)}): {roof['output_tokens_per_s']:.1f} output tok/s "
              f"({roof['bound']}-bound: {roof['flops'] / 1e12:.1f} TFLOP in {roof['flops_s']:.2f} s, "
              f"{roof['bytes'] / 1e9:.1f} GB in {roof['bytes_s']:.2f} s) -> {100 * result['roofline_fraction']:.0f}% reached; "
              f"matmuls then KV traffic ({roof['kv_bytes'] / 1e9:.1f} GB in {roof['kv_s']:.2f} s), one after the other: "
              f"{roof['serial_output_tokens_per_s']:.1f} output tok/s -> {100 * result['serial_roofline_fraction']:.0f}% reached")
    if window is not None:
        try:
            with trace.step_window(engine, ns.trace_dir, *window):
                llm.generate(prompts, params, use_tqdm=False)
        except trace.WindowMissed as e:  # the timed result above stands and is written; the trace is what failed
            print(f"jaxserve: no trace: {e}", file=sys.stderr)
            result["trace"] = {"steps": list(window), "error": str(e)}
        else:
            heading = f"trace of steps {window[0]}..{sum(window) - 1} of the workload run again ({ns.trace_dir}):"
            result["trace"] = {"steps": list(window), **trace.report(ns.trace_dir, heading)}
    if ns.single_stream:
        result["single_stream"] = latency.finish(llm, single_work, single_hf, dtype, rates["copy_bytes_per_s"])
        print(latency.describe(result["single_stream"]))
    if hf is not None:
        result["hf"] = hf
        result["speedup_vs_hf"] = result["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(
            f"HF transformers generate (static batches of {ns.hf_batch_size}): "
            f"{hf['output_tokens_per_s']:.1f} output tok/s -> jaxserve is {result['speedup_vs_hf']:.2f}x"
        )
    print(json.dumps(result, indent=1))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if "error" in result.get("trace", {}) else 0  # the numbers are written; the missed trace still fails


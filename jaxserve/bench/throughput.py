"""`jaxserve bench throughput`: offline output tokens/s and requests/s, optionally beside HF transformers.

With --compare-hf the same prompts run through transformers' `generate` in static batches (EOS ignored,
each batch padded on the left and run to its longest requested output) in a subprocess of the same job,
and the ratio of asked-for output tokens per second is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


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
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench.workload import dataset_workload, random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.text_config.vocab_size
    if ns.dataset:
        work = dataset_workload(ns.dataset, llm.get_tokenizer(), ns.output_len)
    else:
        # Stay clear of special tokens at the top of small vocabularies.
        work = random_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, seed=0,
                               token_range=(100, min(vocab, 32000)))
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]

    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm the host paths; shapes are precompiled
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(w.prompt_token_ids) for w in work)
    result = {
        "engine": "jaxserve",
        "model": engine.model_config.served_model_name,
        "num_prompts": len(work),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(work) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "startup_s": startup_s,
        "engine_info": engine.info(),
        # A data-parallel router has not started JAX on the devices (its replicas hold them): ask them.
        "device": engine.info().get("device_kind") or str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"jaxserve: {len(work)} requests in {elapsed:.2f}s: {result['requests_per_s']:.2f} req/s, "
        f"{result['output_tokens_per_s']:.1f} output tok/s, {result['total_tokens_per_s']:.1f} total tok/s"
    )
    if ns.compare_hf:
        hf = _run_hf_baseline(engine.model_config.model, work, ns.hf_batch_size)
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
    return 0


def _run_hf_baseline(model_path: str, work, batch_size: int) -> dict:
    """Run jaxserve/bench/hf_generate.py in a subprocess (torch stays out of this process)."""
    with tempfile.TemporaryDirectory() as d:
        req = os.path.join(d, "work.json")
        res = os.path.join(d, "result.json")
        with open(req, "w") as f:
            json.dump({"model": model_path, "batch_size": batch_size,
                       "requests": [[w.prompt_token_ids, w.output_len] for w in work]}, f)
        cmd = [sys.executable, "-m", "jaxserve.bench.hf_generate", req, res]
        subprocess.run(cmd, check=True)
        with open(res) as f:
            return json.load(f)

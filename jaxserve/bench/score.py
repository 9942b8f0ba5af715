"""`jaxserve bench score`: offline prompt scoring (each prompt token's logprob), optionally beside HF transformers.

This is an evaluation harness's loglikelihood workload (the completions API's echo with logprobs, max_tokens=0):
--num-prompts random prompts of about --input-len tokens, each scored with ``prompt_logprobs=--k`` and one
token generated. Reported: prompt tokens/s, the same prompts prefilled without prompt logprobs (what scoring
costs on top of the prefill), and with --compare-hf HF's forward pass + log-softmax over the same prompts in
length-sorted static batches (jaxserve.bench.hf_score), with the ratio and how far the two sides' per-prompt
logprob sums are apart. Both sides run in the engine's dtype.

    jaxserve bench score [--model DIR] [--num-prompts 64 --input-len 256 --k 1] [--compare-hf]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("score", help="offline prompt scoring with prompt logprobs (prompt tokens/s)")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=64)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=256)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.5,
                   help="prompt lengths uniform in input-len * (1 -/+ ratio)")
    p.add_argument("--k", type=int, default=1, help="top alternatives per prompt position (prompt_logprobs=k)")
    p.add_argument("--compare-hf", "--compare_hf", dest="compare_hf", action="store_true",
                   help="also score with HF transformers' forward pass (needs torch)")
    p.add_argument("--hf-batch-size", "--hf_batch_size", dest="hf_batch_size", type=int, default=16)
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:

    from jaxserve.bench import latency, report
    from jaxserve.bench.workload import random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    path, cfg = latency.model_path_and_config(args)
    work = random_workload(ns.num_prompts, ns.input_len, 1, ns.range_ratio, cfg.vocab_size, seed=0,
                           token_range=(100, min(cfg.vocab_size, 32000)))
    prompts = [w.prompt_token_ids for w in work]
    tokens = sum(len(p) for p in prompts)
    dtype = latency.resolve_dtype(args.dtype)
    hf = None
    if ns.compare_hf:  # first, in its own process, while no JAX process holds the device's memory
        from jaxserve.bench.hf_score import run_in_subprocess

        hf = run_in_subprocess(path, prompts, ns.hf_batch_size, dtype, ns.k)
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    batch = [{"prompt_token_ids": p} for p in prompts]
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=ns.k)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    # Warm-up: every step shape the runs reach, with and without prompt logprobs (the scoring variants compile on
    # first use), outside the timings.
    # The cache is emptied before every plain run: one that read the blocks an earlier run cached would prefill
    # only each prompt's last token, warm up the wrong shapes, and leave the timed run to compile its own.
    llm.generate(batch, scored, use_tqdm=False)
    _reset_prefix_cache(engine)
    llm.generate(batch, plain, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(batch, scored, use_tqdm=True)
    elapsed = time.perf_counter() - start
    _reset_prefix_cache(engine)
    start = time.perf_counter()
    llm.generate(batch, plain, use_tqdm=False)
    plain_s = time.perf_counter() - start
    sums = [sum(next(iter(e.values())).logprob for e in o.prompt_logprobs[1:]) for o in outs]
    result = {
        "engine": "jaxserve",
        "model": engine.model_config.served_model_name,
        "workload": dict(num_prompts=ns.num_prompts, input_len=ns.input_len, range_ratio=ns.range_ratio, k=ns.k),
        "prompt_tokens": tokens,
        "elapsed_s": elapsed,
        "prompt_tokens_per_s": tokens / elapsed,
        "plain_prefill_s": plain_s,
        "plain_prefill_tokens_per_s": tokens / plain_s,
        "scoring_overhead": elapsed / plain_s - 1.0,
        "startup_s": startup_s,
        "logprob_sums": sums,
        **report.run_fields(engine, args),
    }
    print(f"jaxserve: {len(prompts)} prompts ({tokens} tokens) scored (prompt_logprobs={ns.k}) in {elapsed:.2f}s: "
          f"{result['prompt_tokens_per_s']:.0f} prompt tok/s; the same prompts without prompt logprobs "
          f"{result['plain_prefill_tokens_per_s']:.0f} tok/s (scoring costs {100 * result['scoring_overhead']:+.0f}%)")
    if hf is not None:
        result["hf"] = hf
        result["speedup_vs_hf"] = result["prompt_tokens_per_s"] / hf["prompt_tokens_per_s"]
        diffs = [abs(a - b) for a, b in zip(sums, hf["logprob_sums"])]
        result["max_abs_logprob_sum_diff"] = max(diffs)
        result["max_rel_logprob_sum_diff"] = max(d / max(1e-9, abs(b)) for d, b in zip(diffs, hf["logprob_sums"]))
        print(f"HF transformers forward + log-softmax (length-sorted batches of {ns.hf_batch_size}): "
              f"{hf['prompt_tokens_per_s']:.0f} prompt tok/s -> jaxserve is {result['speedup_vs_hf']:.2f}x; "
              f"per-prompt logprob sums differ by at most {result['max_abs_logprob_sum_diff']:.2e} "
              f"({100 * result['max_rel_logprob_sum_diff']:.2g}%)")
    print(json.dumps({k: v for k, v in result.items() if k != "logprob_sums"} | (
        {"hf": {k: v for k, v in hf.items() if k != "logprob_sums"}} if hf else {}), indent=1))
    report.write_json(result, ns.output_json)
    return 0


def _reset_prefix_cache(engine) -> None:
    """Empty the prefix cache (scored requests never read it; a plain prefill would). A data-parallel router's
    replicas keep theirs: its plain row then reads what the earlier runs cached."""
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None:
        scheduler.reset_prefix_cache()

"""`jaxserve bench lora`: offline and single-stream tokens/s with multi-LoRA against the same engine without.

    jaxserve bench lora --model DIR --load-format dummy --num-loras 4 --lora-rank 16

Each side runs in a process of its own (each engine takes most of the device memory): "plain" is the engine
without LoRA; "lora" is the same engine with ``--enable-lora --max-loras N``, serving random rank-r adapters
on all seven projections (jaxserve.lora.dummy) with the offline requests spread round-robin over the base
model and the N adapters, and the single-stream requests on adapter 1. Printed side by side with the ratios
(issue 16's targets: offline >= 0.80, single stream >= 0.85).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxserve.bench.latency import add_single_stream_args


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("lora", help="offline and single-stream tokens/s with N LoRA adapters vs without LoRA")
    p.add_argument("--num-loras", "--num_loras", dest="num_loras", type=int, default=4)
    p.add_argument("--lora-rank", "--lora_rank", dest="lora_rank", type=int, default=16)
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=256)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=256)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=256)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.5)
    add_single_stream_args(p, prefix="single-stream")
    p.add_argument("--variant", choices=("plain", "lora"), default=None,
                   help="run one side only, in this process (the default runs both, each in a child process)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    if ns.variant is not None:
        result = run_variant(ns)
        if ns.output_json:
            with open(ns.output_json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-lora-") as tmp:
        for variant in ("plain", "lora"):
            out = os.path.join(tmp, f"{variant}.json")
            cmd = [sys.executable, "-m", "jaxserve.cli", *sys.argv[1:], "--variant", variant, "--output-json", out]
            subprocess.run(cmd, check=True)
            with open(out) as f:
                results[variant] = json.load(f)
    plain, lora = results["plain"], results["lora"]
    summary = {
        "num_loras": ns.num_loras, "lora_rank": ns.lora_rank,
        "offline_tokens_per_s": {"plain": plain["output_tokens_per_s"], "lora": lora["output_tokens_per_s"]},
        "offline_ratio": lora["output_tokens_per_s"] / plain["output_tokens_per_s"],
        "single_stream_tokens_per_s": {"plain": plain["single_stream"]["tokens_per_s"],
                                       "lora": lora["single_stream"]["tokens_per_s"]},
        "single_stream_ratio": lora["single_stream"]["tokens_per_s"] / plain["single_stream"]["tokens_per_s"],
        "plain": plain, "lora": lora,
    }
    print(f"\n{'':24s}{'no LoRA':>12s}{'LoRA':>12s}{'ratio':>8s}")
    for key, label in (("offline", "offline output tok/s"), ("single_stream", "single-stream tok/s")):
        v = summary[f"{key}_tokens_per_s"]
        print(f"{label:24s}{v['plain']:12.1f}{v['lora']:12.1f}{summary[f'{key}_ratio']:8.3f}")
    print(f"({ns.num_loras} adapters of rank {ns.lora_rank} on q/k/v/o/gate/up/down; offline requests round-robin "
          f"over the base and the adapters; single stream on one adapter)")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


class _WithLoRA:
    """An LLM whose generate calls all run under one adapter (for bench latency's single-stream measure)."""

    def __init__(self, llm, lora_request):
        self.llm, self.lora_request, self.llm_engine = llm, lora_request, llm.llm_engine

    def generate(self, prompts, params, use_tqdm=False):
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=self.lora_request)


def run_variant(ns: argparse.Namespace) -> dict:
    import jax

    from jaxserve.bench import latency
    from jaxserve.bench.workload import random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.lora.dummy import write_dummy_adapter
    from jaxserve.lora.request import LoRARequest
    from jaxserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    path, cfg = latency.model_path_and_config(args)
    loras: list = [None]
    tmp = tempfile.mkdtemp(prefix="jaxserve-dummy-lora-")
    if ns.variant == "lora":
        args = dataclasses.replace(args, enable_lora=True, max_loras=max(args.max_loras, ns.num_loras),
                                   max_lora_rank=max(args.max_lora_rank, ns.lora_rank))
        t0 = time.perf_counter()
        for i in range(ns.num_loras):
            adapter = write_dummy_adapter(os.path.join(tmp, f"lora{i + 1}"), cfg, ns.lora_rank, seed=i)
            loras.append(LoRARequest(f"lora{i + 1}", i + 1, adapter))
        print(f"wrote {ns.num_loras} random rank-{ns.lora_rank} adapters in {time.perf_counter() - t0:.1f}s")
    work = random_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, cfg.vocab_size, seed=0,
                           token_range=(100, min(cfg.vocab_size, 32000)))
    single_work = latency.single_stream_work(cfg.vocab_size, ns.single_stream_input_len, ns.single_stream_output_len,
                                             ns.single_stream_repeats)
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]
    per_request = [loras[i % len(loras)] for i in range(len(work))]
    # Warm-up: every adapter read and placed in a slot, the host paths exercised (shapes are precompiled).
    n = len(loras)
    llm.generate(prompts[:n], [p.clone(max_tokens=2) for p in params[:n]], use_tqdm=False, lora_request=per_request[:n])
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True, lora_request=per_request)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    single = latency.measure(_WithLoRA(llm, loras[1]) if ns.variant == "lora" else llm, single_work)
    result = {
        "variant": ns.variant, "num_loras": ns.num_loras if ns.variant == "lora" else 0, "lora_rank": ns.lora_rank,
        "num_prompts": len(work), "output_tokens": out_tokens, "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed, "single_stream": single, "startup_s": startup_s,
        "engine_info": llm.llm_engine.info(), "device": str(jax.devices()[0].device_kind),
    }
    print(f"{ns.variant}: {out_tokens / elapsed:.1f} output tok/s offline, {single['tokens_per_s']:.1f} tok/s single "
          f"stream (decode {single['decode_tokens_per_s']:.1f})")
    return result

"""`jaxserve bench latency`: single-stream decode speed (one request at a time) against the weight-read roofline.

    jaxserve bench latency --model DIR --load-format dummy --input-len 128 --output-len 256 --repeats 5 --compare-hf

Each repeat sends one fresh random prompt (distinct, so the prefix cache never helps) of exactly input-len
tokens and asks for exactly output-len tokens, EOS ignored. Reported: the median over repeats of output
tokens / end-to-end seconds (prefill included, as HF's side is measured) and of the decode-only rate
((tokens - 1) / time after the first token). The roofline is weight bytes / the copy rate measured in the
same job (every decode token reads every weight once); the fraction reached is the decode rate over it.
With --compare-hf, HF transformers `generate` runs the same prompts one at a time in a subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("latency", help="single-stream decode tokens/s against the weight-read roofline")
    add_single_stream_args(p)
    p.add_argument("--compare-hf", "--compare_hf", dest="compare_hf", action="store_true",
                   help="also time HF transformers generate on the same prompts, one at a time (needs torch)")
    p.add_argument("--quick", action="store_true", help="small roofline measurements (smoke runs, CPU tests)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    p.add_argument("--trace-dir", default=None,
                   help="also trace one more request with the JAX profiler into this directory, and print where "
                        "its time went (jaxserve.bench.trace)")
    add_engine_args(p)
    p.set_defaults(func=run)


def add_single_stream_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """--input-len/--output-len/--repeats (or, with a prefix, --single-stream-input-len, ...)."""
    flag = f"--{prefix}-" if prefix else "--"
    dest = f"{prefix.replace('-', '_')}_" if prefix else ""
    p.add_argument(f"{flag}input-len", dest=f"{dest}input_len", type=int, default=128)
    p.add_argument(f"{flag}output-len", dest=f"{dest}output_len", type=int, default=256)
    p.add_argument(f"{flag}repeats", dest=f"{dest}repeats", type=int, default=5, help="timed requests (median)")


def check_args(input_len: int, output_len: int, repeats: int, flag: str = "--") -> None:
    for name, value, least in (("input-len", input_len, 1), ("output-len", output_len, 2), ("repeats", repeats, 1)):
        if value < least:
            raise ValueError(f"{flag}{name}={value} is invalid: must be >= {least}")


def resolve_dtype(dtype: str) -> str:
    """EngineArgs' dtype as the engine will resolve it ("auto": bfloat16 on accelerators, float32 on CPU).

    The platform is asked of a child process: JAX on a GPU takes most of its memory when it starts, and HF's
    side must run before that, in a process of its own."""
    if dtype != "auto":
        return dtype
    from jaxserve.bench.sweep import _probe_devices

    return "float32" if _probe_devices()["platform"] == "cpu" else "bfloat16"


def model_path_and_config(args):
    """The model's path and text config, read without JAX (see resolve_dtype)."""
    from jaxserve.model_loader import read_text_config, resolve_model_path

    path, _ = resolve_model_path(args.model, args.load_format)
    return path, read_text_config(path)


def single_stream_work(vocab: int, input_len: int, output_len: int, repeats: int) -> list:
    """repeats + 1 distinct prompts (the first warms up), exact lengths."""
    from jaxserve.bench.workload import random_workload

    return random_workload(repeats + 1, input_len, output_len, 0.0, vocab, seed=1,
                           token_range=(min(100, vocab // 2), min(vocab, 32000)))


def measure(llm, work: list) -> dict:
    """Time work[1:] one request at a time through ``llm`` (work[0] warms up)."""
    from jaxserve.sampling_params import SamplingParams

    def one(w):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": w.prompt_token_ids}], [params], use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        n, m = len(out.outputs[0].token_ids), out.metrics
        return n / elapsed, (n - 1) / (m["finish_time"] - m["first_token_time"]), 1000 * (m["first_token_time"] - m["arrival_time"])

    one(work[0])
    loop = getattr(llm.llm_engine, "loop_time", None)  # host vs waiting-for-device split (one engine)
    before = dict(loop) if loop else None
    spec = getattr(llm.llm_engine, "speculator", None)
    spec_before = spec.stats.engine_stats() if spec is not None else None
    runs = [one(w) for w in work[1:]]
    steps = {k: loop[k] - before[k] for k in loop} if loop else None
    return {
        **({"spec_decode": spec_decode_summary(spec_before, spec.stats.engine_stats())} if spec is not None else {}),
        "loop_ms_per_step": None if not steps or not steps["steps"] else {
            "total": 1e3 * steps["total_s"] / steps["steps"],
            "host": 1e3 * (steps["total_s"] - steps["wait_s"]) / steps["steps"],
            "wait": 1e3 * steps["wait_s"] / steps["steps"],
            # with speculation: the proposer's round (host and its device wait), part of "host"
            "propose": 1e3 * steps.get("propose_s", 0.0) / steps["steps"],
        },
        "input_len": len(work[0].prompt_token_ids), "output_len": work[0].output_len, "repeats": len(runs),
        "tokens_per_s": statistics.median(r[0] for r in runs),
        "decode_tokens_per_s": statistics.median(r[1] for r in runs),
        "ttft_ms": statistics.median(r[2] for r in runs),
        "runs_tokens_per_s": [r[0] for r in runs],
    }


def traced_request(llm, w, trace_dir: str) -> dict:
    """One more request of ``w``'s prompt and length under the JAX profiler (not timed); prints and returns the
    trace's summary (jaxserve.bench.trace)."""
    from jaxserve.bench import trace
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len)
    with trace.capture(trace_dir):
        llm.generate([{"prompt_token_ids": w.prompt_token_ids}], [params], use_tqdm=False)
    return trace.report(trace_dir, f"trace of one request ({trace_dir}):")


def spec_decode_summary(before: dict, after: dict) -> dict:
    """vLLM's spec-decode figures over the timed requests (EngineStats' spec_* fields, before and after)."""
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["spec_accepted_per_pos"], before["spec_accepted_per_pos"])]
    return {
        "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "acceptance_rate_per_pos": [a / drafts if drafts else 0.0 for a in per_pos],
    }


def hf_single_stream(model_path: str, dtype: str, work: list) -> dict:
    """HF generate on work[1:], batches of one, in a subprocess; the median rate over the requests."""
    from jaxserve.bench.hf_generate import run_in_subprocess

    hf = run_in_subprocess(model_path, work[1:], batch_size=1, dtype=dtype)
    rates = [w.output_len / s for w, s in zip(work[1:], hf["batch_s"])]
    return {**hf, "tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates}


def with_roofline(res: dict, cfg, dtype: str, copy_rate: float, held_bytes: int | None = None) -> dict:
    from jaxserve.bench import roofline

    roof = roofline.single_stream(cfg, dtype, copy_rate, held_bytes)
    return {**res, "roofline": roof, "roofline_fraction": res["decode_tokens_per_s"] / roof["tokens_per_s"]}


def describe(res: dict) -> str:
    text = (f"single stream {res['input_len']} -> {res['output_len']} tokens: {res['tokens_per_s']:.1f} tok/s "
            f"(decode only {res['decode_tokens_per_s']:.1f}, TTFT {res['ttft_ms']:.0f} ms; median of {res['repeats']})")
    if "roofline" in res:
        text += (f"; weight-read roofline {res['roofline']['tokens_per_s']:.1f} tok/s "
                 f"({res['roofline']['weight_bytes'] / 1e6:.1f} MB at {res['roofline']['copy_bytes_per_s'] / 1e12:.3f} TB/s): "
                 f"{100 * res['roofline_fraction']:.0f}% reached")
    if "spec_decode" in res:
        sd = res["spec_decode"]
        text += (f"\nspeculative decoding: {sd['num_drafts']} drafts, acceptance rate {sd['acceptance_rate']:.3f}, "
                 f"mean acceptance length {sd['mean_acceptance_length']:.2f}, per position "
                 + " ".join(f"{a:.2f}" for a in sd["acceptance_rate_per_pos"]))
    if "hf" in res:
        text += f"\nHF transformers generate, same prompts one at a time: {res['hf']['tokens_per_s']:.1f} tok/s -> jaxserve is {res['speedup_vs_hf']:.2f}x"
    return text


def prepare(ns, prefix: str, model_path: str, cfg, dtype: str) -> tuple[list, dict | None]:
    """The single-stream prompts, and HF's run on them with --compare-hf (before any engine exists)."""
    input_len, output_len, repeats = (getattr(ns, f"{prefix}{k}") for k in ("input_len", "output_len", "repeats"))
    check_args(input_len, output_len, repeats, flag=f"--{prefix.replace('_', '-')}")
    work = single_stream_work(cfg.vocab_size, input_len, output_len, repeats)
    return work, (hf_single_stream(model_path, dtype, work) if ns.compare_hf else None)


def finish(llm, work: list, hf: dict | None, dtype: str, copy_rate: float) -> dict:
    """Time ``work`` on the engine, add the roofline and HF's rate; also used by `bench throughput`."""
    params = getattr(getattr(llm.llm_engine, "runner", None), "params", ())  # a DP router holds none
    quantized = any(str(p.dtype) in ("int8", "float8_e4m3fn") for p in params)  # GGUF codes, fp8 weights
    held = sum(int(p.nbytes) for p in params) if quantized else None
    res = with_roofline(measure(llm, work), llm.llm_engine.text_config, dtype, copy_rate, held)
    if hf is not None:
        res["hf"] = hf
        res["speedup_vs_hf"] = res["tokens_per_s"] / hf["tokens_per_s"]
    return res


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench import roofline
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM

    args = engine_args_from(ns)
    path, cfg = model_path_and_config(args)
    dtype = resolve_dtype(args.dtype)
    work, hf = prepare(ns, "", path, cfg, dtype)
    rates = roofline.measure_rates(dtype, quick=ns.quick, matmul=False)  # before the KV cache takes the memory
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    res = finish(llm, work, hf, dtype, rates["copy_bytes_per_s"])
    result = {"engine": "jaxserve", "bench": "latency", **res, "startup_s": startup_s,
              "engine_info": llm.llm_engine.info(), **environment(jax)}
    print(describe(result))
    if ns.trace_dir:
        result["trace"] = traced_request(llm, work[-1], ns.trace_dir)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def environment(jax) -> dict:
    return {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}

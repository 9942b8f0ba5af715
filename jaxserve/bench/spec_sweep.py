"""`jaxserve bench spec-sweep`: single-stream tokens/s at each forced acceptance length 0..k, in one engine.

    jaxserve bench spec-sweep --model DIR --load-format dummy --max-model-len 1024 \\
        --speculative-config '{"model": "DRAFT_DIR", "num_speculative_tokens": 4}'

Dummy weights accept nothing on their own, so the timing of a speculative step is read at a forced acceptance
length (``forced_acceptance_length``, a benchmark-only key of ``speculative_config``: the verify step accepts
min(a, proposals) whatever the tokens are; the tokens are then not the model's). The engine is built once; for
each a = 0..k only the verify programs are rebuilt, which costs seconds where a new engine costs a model load.
Without ``--speculative-config`` the same prompts run without speculation (the baseline row). Each row: one
warm-up request, then ``--repeats`` fresh random prompts of ``--input-len`` tokens -> ``--output-len`` tokens
(EOS ignored); the median of output tokens / end-to-end seconds, and the loop's ms per step split into host
work and waiting for the device. ``--acceptance 3,0`` runs only those lengths, in that order (the goal's row
first when a device call's time is short); the JSON is rewritten after every row, so a cut-off run keeps the
rows it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("spec-sweep", help="single stream at each forced acceptance length 0..k (dummy weights)")
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed requests per acceptance length (median)")
    p.add_argument("--acceptance", default=None,
                   help="comma-separated forced acceptance lengths to time, in this order (default: 0..k)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    p.add_argument("--trace-dir", default=None,
                   help="also trace one more request per row with the JAX profiler, into DIR/a<length> (DIR/base "
                        "without speculation), and print where its time went (jaxserve.bench.trace)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _timed(llm, prompt_len: int, output_len: int, rng) -> dict:
    from jaxserve.sampling_params import SamplingParams

    engine = llm.llm_engine
    vocab = engine.text_config.vocab_size
    prompt = {"prompt_token_ids": rng.integers(min(100, vocab // 4), min(30000, vocab), prompt_len).tolist()}
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    loop0 = dict(engine.loop_time)
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    d = {k: engine.loop_time[k] - loop0[k] for k in loop0}
    steps = max(1, d["steps"])
    return {"tok_s": len(out.token_ids) / seconds, "steps": d["steps"], "ms_per_step": 1e3 * d["total_s"] / steps,
            "wait_ms_per_step": 1e3 * d["wait_s"] / steps, "propose_ms_per_step": 1e3 * d["propose_s"] / steps}  # fmt: skip


def acceptance_lengths(text: str | None, k: int | None) -> list[int | None]:
    """The forced acceptance lengths to time, in order: ``[None]`` (the baseline) without speculation."""
    if k is None:
        if text:
            raise ValueError(f"--acceptance={text!r} needs --speculative-config: without it only the baseline runs")
        return [None]
    if not text:
        return list(range(k + 1))
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or any(not 0 <= a <= k for a in lengths):
        raise ValueError(f"--acceptance={text!r} is invalid: give comma-separated integers in 0..{k} "
                         f"(num_speculative_tokens), e.g. 3,0,{k}")  # fmt: skip
    return lengths


def sweep(llm, input_len: int, output_len: int, repeats: int, seed: int = 0, lengths=None, on_row=None,
          trace_dir: str | None = None) -> list[dict]:
    import numpy as np

    from jaxserve.spec_decode.verify import VerifyRunner

    engine = llm.llm_engine
    spec = engine.speculator
    rng = np.random.default_rng(seed)
    rows = []
    for a in lengths if lengths is not None else acceptance_lengths(None, None if spec is None else spec.k):
        if spec is not None:  # the verify programs take the forced length as a static argument: rebuild them
            spec.config = dataclasses.replace(spec.config, forced_acceptance_length=a)
            spec.verifier = VerifyRunner(engine.runner, spec.k, a)
            spec.verifier.warmup()
        _timed(llm, input_len, output_len, rng)  # warm-up (lazy compiles, the draft's rounds)
        before = None if spec is None else (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens)
        runs = [_timed(llm, input_len, output_len, rng) for _ in range(repeats)]
        row = {"forced_acceptance_length": a, "tok_s": statistics.median(r["tok_s"] for r in runs),
               "ms_per_step": statistics.median(r["ms_per_step"] for r in runs),
               "wait_ms_per_step": statistics.median(r["wait_ms_per_step"] for r in runs), "runs": runs}  # fmt: skip
        if spec is not None:
            row["draft_tokens"] = spec.stats.num_draft_tokens - before[0]
            row["accepted_tokens"] = spec.stats.num_accepted_tokens - before[1]
        rows.append(row)
        print(format_row(row), flush=True)
        if trace_dir:  # one more request, not timed, under the profiler
            from jaxserve.bench import trace

            where = os.path.join(trace_dir, "base" if a is None else f"a{a}")
            with trace.capture(where):
                _timed(llm, input_len, output_len, rng)
            row["trace"] = trace.report(where, f"trace of one more request ({where}):")
        if on_row:
            on_row(rows)
    return rows


def format_row(row: dict) -> str:
    a = row["forced_acceptance_length"]
    head = "no speculation" if a is None else f"forced acceptance {a}"
    return (f"{head}: {row['tok_s']:.1f} tok/s, {row['ms_per_step']:.2f} ms/step "
            f"({row['wait_ms_per_step']:.2f} waiting for the device)")  # fmt: skip


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench.latency import check_args, environment
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM

    check_args(ns.input_len, ns.output_len, ns.repeats)
    args = engine_args_from(ns)
    spec = json.loads(args.speculative_config) if isinstance(args.speculative_config, str) else args.speculative_config
    k = None
    if spec is not None:
        spec = {**spec, "forced_acceptance_length": 0}  # replaced row by row
        k = spec.get("num_speculative_tokens")
    valid_k = spec is None or (isinstance(k, int) and k >= 1)  # else the engine's config check names the error
    lengths = acceptance_lengths(ns.acceptance, k) if valid_k else None  # checked before the model loads
    start = time.perf_counter()
    llm = LLM(**{**dataclasses.asdict(args), "speculative_config": spec})
    startup_s = time.perf_counter() - start

    def write(rows: list[dict]) -> None:
        result = {"engine": "jaxserve", "bench": "spec-sweep", "input_len": ns.input_len, "output_len": ns.output_len,
                  "repeats": ns.repeats, "speculative_config": spec, "startup_s": startup_s, "rows": rows,
                  "engine_info": llm.llm_engine.info(), **environment(jax)}  # fmt: skip
        if ns.output_json:
            with open(ns.output_json, "w") as f:
                json.dump(result, f, indent=1)

    sweep(llm, ns.input_len, ns.output_len, ns.repeats, ns.seed or 0, lengths=lengths, on_row=write,
          trace_dir=ns.trace_dir)
    return 0

"""`jaxserve bench spec-decode`: single-stream tokens/s with speculative decoding against the same engine without.

    jaxserve bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'

Chat prompts that ask the model to repeat or edit a code snippet (prompt lookup's best case: the answer
quotes the input), greedy, one request at a time. Each prompt runs with the speculator and without it
(``engine.speculator`` switched off: the plain asynchronous loop), interleaved, so both see the same machine
load; the first pass over the prompts warms up (compiles). Reported: tokens/s of each, the speed-up, whether
the tokens were identical (they must be, greedy), vLLM's acceptance figures, and the loop's ms per step split
into host work and waiting for the device. Needs a model with a chat template (the default model has one).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time

_CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    i, j, out = 0, 0, []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
PROMPTS = [
    "Rename the function merge_sorted to merge_lists in this code and print the whole code again:\n\n" + _CODE,
    "Add type hints (list[int]) to this Python function and show the full updated code:\n\n" + _CODE,
    "Repeat this code exactly, then explain it in one sentence:\n\n" + _CODE,
]


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("spec-decode", help="single-stream tokens/s with speculative decoding vs without")
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=200, help="max_tokens")
    p.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def measure(llm, output_len: int, repeats: int) -> dict:
    from jaxserve.bench.latency import spec_decode_summary
    from jaxserve.sampling_params import SamplingParams

    engine = llm.llm_engine
    spec = engine.speculator
    if spec is None:
        raise ValueError("bench spec-decode needs --speculative-config (e.g. '{\"method\": \"ngram\", "
                         "\"num_speculative_tokens\": 3}')")
    sp = SamplingParams(temperature=0, max_tokens=output_len)
    totals = {True: collections.Counter(), False: collections.Counter()}

    def one(prompt: str, on: bool, timed: bool) -> list[int]:
        engine.speculator = spec if on else None
        loop0 = dict(engine.loop_time)
        start = time.perf_counter()
        try:
            out = llm.chat([{"role": "user", "content": prompt}], sp, use_tqdm=False)[0].outputs[0]
        finally:
            engine.speculator = spec
        if timed:
            t = totals[on]
            t["tokens"] += len(out.token_ids)
            t["s"] += time.perf_counter() - start
            for k in loop0:
                t[k] += engine.loop_time[k] - loop0[k]
        return out.token_ids

    for p in PROMPTS:
        one(p, True, False), one(p, False, False)
    before = spec.stats.engine_stats()
    identical = True
    for _ in range(repeats):
        for p in PROMPTS:
            identical &= one(p, True, True) == one(p, False, True)
    rate = {on: t["tokens"] / t["s"] for on, t in totals.items()}
    return {
        "spec_tokens_per_s": rate[True], "plain_tokens_per_s": rate[False], "speedup": rate[True] / rate[False],
        "identical_tokens": identical, "spec_decode": spec_decode_summary(before, spec.stats.engine_stats()),
        "loop_ms_per_step": {
            ("spec" if on else "plain"): {
                "steps": t["steps"], "host": 1e3 * (t["total_s"] - t["wait_s"]) / t["steps"],
                "wait": 1e3 * t["wait_s"] / t["steps"], "propose": 1e3 * t["propose_s"] / t["steps"],
            } for on, t in totals.items()
        },
        "speculative_config": dataclasses.asdict(spec.config), "output_len": output_len, "repeats": repeats,
    }  # fmt: skip


def describe(res: dict) -> str:
    sd, loop = res["spec_decode"], res["loop_ms_per_step"]
    return (
        f"single stream, code-edit prompts: {res['spec_tokens_per_s']:.1f} tok/s with speculation, "
        f"{res['plain_tokens_per_s']:.1f} without: {res['speedup']:.2f}x "
        f"(identical tokens: {res['identical_tokens']})\n"
        f"acceptance rate {sd['acceptance_rate']:.3f}, mean acceptance length {sd['mean_acceptance_length']:.2f}, "
        f"per position " + " ".join(f"{a:.2f}" for a in sd["acceptance_rate_per_pos"]) + "\n"
        + "; ".join(f"{name}: {v['host']:.2f} ms host (of which {v['propose']:.2f} proposing) + {v['wait']:.2f} ms "
                    f"waiting per step ({v['steps']} steps)" for name, v in loop.items())
    )


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench.latency import environment
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM

    if ns.repeats < 1 or ns.output_len < 2:
        raise ValueError(f"--repeats={ns.repeats} and --output-len={ns.output_len} must be >= 1 and >= 2")
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    result = {"engine": "jaxserve", "bench": "spec-decode", **measure(llm, ns.output_len, ns.repeats),
              "engine_info": llm.llm_engine.info(), **environment(jax)}
    print(describe(result))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

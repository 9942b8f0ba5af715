"""The first requests after start-up against the steady ones: what a program's first launch still costs them.

    python -m jaxserve.bench.first_requests --model DIR [--speculative-config JSON] [--requests 5] [--unprimed-speculation] [engine flags]

Starts an engine, then runs ``--requests`` single-stream requests one after another (``--input-len`` random
tokens -> ``--output-len``, EOS ignored) and reports each one's wall time and the first one's excess over the
median of the third and later. On accelerators every start-up program runs once at start-up (the steps since
BENCHMARKS §29, the speculative verify steps and proposal rounds since §30), so that a program's first launch
(its kernels loaded, its command buffer recorded) lands there and not on a request. ``--unprimed-speculation``
skips that for the speculative programs (a diagnostic: the A/B of §30). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    from jaxserve.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.first_requests", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--unprimed-speculation", action="store_true", help="do not prime the speculative programs")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    add_engine_args(p)
    ns = p.parse_args(argv)
    if ns.requests < 3:
        p.error(f"--requests {ns.requests}: need at least 3 (the first, then a steady median from the third on)")
    import dataclasses

    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.spec_decode.draft_program import RoundPrograms
    from jaxserve.spec_decode.verify import VerifyRunner

    primes = RoundPrograms.prime, VerifyRunner.prime
    if ns.unprimed_speculation:
        RoundPrograms.prime = VerifyRunner.prime = lambda self: None
    t0 = time.perf_counter()
    try:
        llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    finally:
        RoundPrograms.prime, VerifyRunner.prime = primes  # the start-up was the only user
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    vocab = llm.llm_engine.text_config.vocab_size
    times = []
    for _ in range(ns.requests):
        ids = rng.integers(100, min(vocab, 30000), ns.input_len).tolist()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    row = dict(primed_speculation=not ns.unprimed_speculation, startup_s=startup, request_s=times,
               first_minus_steady_ms=(times[0] - statistics.median(times[2:])) * 1e3)  # fmt: skip
    print(json.dumps(row), flush=True)
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

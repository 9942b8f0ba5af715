"""Where an offline run's time goes: wall time of every engine step, grouped by (tokens, context) bucket.

    python -m jaxserve.bench.step_profile [--attention-backend xla] [--no-attention] [throughput flags]

Runs the same random workload as `jaxserve bench throughput` (defaults: 64 prompts, 128 in, 64 out, EOS
ignored) and prints, per step shape and kind (prefill / decode / mixed), the number of steps and the
mean time of `ModelRunner.dispatch` until its samples are ready (host batch building + the jitted step +
sampling), with asynchronous scheduling off so that steps do not overlap. `--no-attention`
swaps attention for a bare KV write, to show what the rest of the model costs (a diagnostic, not a
correct model).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time


def _no_attention(q, k_new, v_new, k_pages, v_pages, md, *, scale, sliding_window=None, precision=None):
    from jaxserve.pallas_kernels.reference import write_kv

    k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, md.slot_mapping)
    return q, k_pages, v_pages


def main(argv: list[str] | None = None) -> int:
    from jaxserve.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.step_profile", description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--no-attention", action="store_true", help="replace attention by a KV write (diagnostic)")
    add_engine_args(p)
    ns = p.parse_args(argv)
    args = dataclasses.replace(engine_args_from(ns), async_scheduling=False)  # one step at a time, timed alone
    if args.data_parallel_size > 1:
        p.error("the step profile times one engine's steps in this process: drop --data-parallel-size "
                "(data-parallel replicas run in processes of their own)")
    if not ns.no_attention:
        return _profile(ns, args)
    from jaxserve.pallas_kernels import attention

    # The gather backends share width buckets; patch the reference entry and select it, for this run only (a
    # caller in the same process, e.g. a test session, gets the real reference backend back).
    real = attention.paged_attention
    attention.paged_attention = _no_attention
    attention.get_attention_fn.cache_clear()
    try:
        return _profile(ns, dataclasses.replace(args, attention_backend="reference"))
    finally:
        attention.paged_attention = real
        attention.get_attention_fn.cache_clear()


def _profile(ns: argparse.Namespace, args) -> int:
    import jax

    from jaxserve.bench.workload import random_workload
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    engine = llm.llm_engine
    runner = engine.runner
    work = random_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, engine.text_config.vocab_size,
                           seed=0, token_range=(100, min(engine.text_config.vocab_size, 32000)))  # fmt: skip
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)

    stats: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0])
    dispatch = runner.dispatch

    def timed(sched, **kwargs):  # kwargs: the engine's dispatch options (defer_masks), passed through unchanged
        t, _, b, _ = runner._shapes_for(sched)
        start = time.perf_counter()
        handle = dispatch(sched, **kwargs)
        if handle.sampled is not None:  # a step whose sampler waits (grammar masks) is timed to its launch only
            jax.block_until_ready(handle.sampled)  # the engine runs one step at a time here (see below)
        decodes = sum(len(s.token_ids) == 1 for s in sched.seqs)
        kind = "decode" if decodes == len(sched.seqs) else ("prefill" if decodes == 0 else "mixed")
        entry = stats[(t, b * runner.block_size, kind)]
        entry[0] += 1
        entry[1] += time.perf_counter() - start
        return handle

    runner.dispatch = timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    backend = "none (KV write only)" if ns.no_attention else runner.runner_config.attention_backend
    print(f"attention: {backend}; elapsed {elapsed:.2f} s; steps in execute {sum(v[1] for v in stats.values()):.2f} s")
    print(f"{'tokens':>6} {'context':>7} {'kind':>8} {'steps':>5} {'total s':>8} {'ms/step':>8}")
    for (t, c, kind), (n, total) in sorted(stats.items()):
        print(f"{t:>6} {c:>7} {kind:>8} {n:>5} {total:>8.2f} {1000 * total / n:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

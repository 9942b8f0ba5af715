"""Host cost of the engine loop per step, on CPU with a tiny random Llama (not a test: a measuring script).

    JAX_PLATFORMS=cpu python tests/host_loop_profile.py --seqs 256 [--fake-device] [--split] [--profile] [--cumulative]
    python tests/host_loop_profile.py --model DIR --load-format dummy --seqs 128 --split   # on a GPU

Runs ``--seqs`` prompts of 16 tokens to 128 greedy new tokens (ignore_eos) through LLM.generate (or, with
``--cumulative``, through engine.step with streaming outputs, as the server does) and prints the loop's host
time per step: ``(total_s - wait_s) / steps`` from LLMEngine.loop_time, and that minus the jitted calls'
own dispatch (ModelRunner._run). With ``--profile``, also each host-side function's cumulative ms per step.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

# Python puts this script's folder first on the path, where tests/jaxserve would shadow the installed package:
# import the package first, then the fixtures from this folder.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.sampler import SamplerOutput  # noqa: E402

sys.path.append(_here)
from engine_fixtures import checkpoint  # noqa: E402

# (label, function name as pstats prints it, file suffix): the loop's host-side pieces.
FUNCS = [
    ("schedule", "schedule", "scheduler.py"),
    ("update_from_output", "update_from_output", "scheduler.py"),
    ("output_processor.process", "process", "output_processor.py"),
    ("build_step_inputs", "build_step_inputs", "batch_builder.py"),
    ("SamplingMetadata.from_seqs", "from_seqs", "sampling_metadata.py"),
    ("runner.dispatch", "dispatch", "model_runner.py"),
    ("runner._run (jit call)", "_run", "model_runner.py"),
    ("runner.fetch", "fetch", "model_runner.py"),
    ("engine._finish", "_finish", "llm_engine.py"),
    ("engine.step", "step", "llm_engine.py"),
]


def _time_pieces(engine) -> dict[str, list[float]]:
    """Wrap the loop's host pieces in timers (cheaper than cProfile, so the split is closer to the real one)."""
    import jaxserve.model_runner as model_runner
    from jaxserve.sampling_metadata import SamplingMetadata

    split: dict[str, list[float]] = {}

    def timed(label, fn):
        acc = split.setdefault(label, [0.0])

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t0

        return wrapper

    s, op = engine.scheduler, engine.output_processor
    s.schedule = timed("schedule", s.schedule)
    s.update_from_output = timed("update_from_output", s.update_from_output)
    op.process = timed("output_processor.process", op.process)
    model_runner.build_step_inputs = timed("build_step_inputs", model_runner.build_step_inputs)
    from_seqs = SamplingMetadata.from_seqs
    SamplingMetadata.from_seqs = timed("SamplingMetadata.from_seqs", from_seqs)
    engine.runner.dispatch = timed("runner.dispatch (all)", engine.runner.dispatch)
    return split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--fake-device", action="store_true",
        help="skip the jitted step (every row samples token 5): no XLA threads compete with the host, so the "
        "host's CPU time per step is steady on a loaded machine",
    )  # fmt: skip
    ap.add_argument("--model", default=None, help="a checkpoint instead of the tiny random Llama (GPU runs)")
    ap.add_argument("--load-format", default="auto", help='with --model: "dummy" for random weights')
    ap.add_argument("--split", action="store_true", help="time the host pieces (unprofiled wrappers)")
    ap.add_argument("--cumulative", action="store_true", help="stream every step's outputs (the server's kind)")
    args = ap.parse_args()

    if args.model:  # a real checkpoint (on an accelerator): its dtype, its default cache; prompts of random ids
        llm = LLM(args.model, load_format=args.load_format, max_model_len=1024, max_num_seqs=args.seqs)
    else:
        llm = LLM(
            checkpoint("llama_gqa"), dtype="float32", max_model_len=256, max_num_seqs=args.seqs,
            max_num_batched_tokens=max(4096, 16 * args.seqs), block_size=16, compilation_cache_dir="",
            use_tqdm_on_load=False, precompile="none",
        )  # fmt: skip
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 2 for j in range(16)]} for i in range(args.seqs)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm: every step shape compiled

    if os.environ.get("HOST_LOOP_GC") == "freeze":
        import gc

        gc.freeze()
    engine.loop_time.update(steps=0, total_s=0.0, wait_s=0.0)
    run_s = [0.0]  # the jitted calls' own dispatch, timed around ModelRunner._run
    inner_run = engine.runner._run

    def timed_run(x, sampling_md, *a, **kw):
        t0 = time.perf_counter()
        try:
            if args.fake_device:
                return SamplerOutput(token_ids=np.full(sampling_md.num_rows, 5, np.int32))
            return inner_run(x, sampling_md, *a, **kw)
        finally:
            run_s[0] += time.perf_counter() - t0

    engine.runner._run = timed_run
    split = _time_pieces(engine) if args.split else {}
    prof = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    cpu_start = time.thread_time()
    if prof:
        prof.enable()
    if args.cumulative:
        for i, p in enumerate(prompts):
            engine.add_request(f"c{i}", p, sp)
        while engine.has_unfinished_requests():
            engine.step()
    else:
        llm.generate(prompts, sp, use_tqdm=False)
    if prof:
        prof.disable()
    wall = time.perf_counter() - start
    cpu = time.thread_time() - cpu_start
    lt = engine.loop_time
    steps = lt["steps"]
    host_ms = (lt["total_s"] - lt["wait_s"]) / steps * 1e3
    run_ms = run_s[0] / steps * 1e3
    print(f"seqs={args.seqs} steps={steps} wall={wall:.2f}s host_ms/step={host_ms:.3f} "
          f"jit_call_ms/step={run_ms:.3f} host_minus_jit_ms/step={host_ms - run_ms:.3f} "
          f"wait_ms/step={lt['wait_s'] / steps * 1e3:.3f} thread_cpu_ms/step={cpu / steps * 1e3:.3f}")  # fmt: skip
    for label, seconds in split.items():
        print(f"  {label:28s} {seconds[0] / steps * 1e3:8.3f} ms/step")
    if prof:
        stats = pstats.Stats(prof).stats
        for label, name, suffix in FUNCS:
            ct = sum(v[3] for (f, _, fn), v in stats.items() if fn == name and f.endswith(suffix))
            calls = sum(v[1] for (f, _, fn), v in stats.items() if fn == name and f.endswith(suffix))
            print(f"  {label:28s} {ct / steps * 1e3:8.3f} ms/step  ({calls} calls)")
        if os.environ.get("HOST_LOOP_TOP"):  # the top functions by own time
            pstats.Stats(prof).sort_stats("tottime").print_stats(int(os.environ["HOST_LOOP_TOP"]))
        fin = sum(v[1] for (f, _, fn), v in stats.items() if fn == "is_finished")
        print(f"  is_finished calls: {fin}")


if __name__ == "__main__":
    main()

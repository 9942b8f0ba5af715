"""Host cost of a speculative verify step, split by piece, on CPU with a tiny random Llama (a measuring script).

    JAX_PLATFORMS=cpu python tests/spec_host_profile.py [--k 4] [--accept 3] [--new-tokens 256] [--repeats 5]
    python tests/spec_host_profile.py --model DIR --load-format dummy      # on a GPU

One stream, the n-gram proposer with ``forced_acceptance_length`` (it pads its proposals to k, so every step
verifies k proposals and accepts ``--accept`` of them), greedy, EOS ignored: the workload of
``jaxserve bench spec-sweep``. Each piece of the loop is wrapped in a timer; the device wait is timed apart by
blocking on the verify step's arrays before they are read back. Prints ms per step for each piece, the loop's
host time (step time minus the wait) and the part not inside any timed piece ("engine, other"). A statistic of
``--repeats`` runs (``--stat``, the minimum by default; the host time is the statistic of each run's step time
minus its wait).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Python puts this script's folder first on the path, where tests/jaxserve would shadow the installed package.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
import jax  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402

sys.path.append(_here)
from engine_fixtures import checkpoint  # noqa: E402


def _timer(split: dict, label: str, fn):
    split.setdefault(label, 0.0)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            split[label] += time.perf_counter() - t0

    return wrapper


FAKE_DEVICE = False


def _fake_program(verifier):
    """--fake-device: a stand-in for the compiled verify program that returns fixed arrays already on the device
    (every step emits ``forced`` + 1 tokens of id 5), so the loop's host work is timed without the device's."""
    import jax.numpy as jnp
    import numpy as np

    import jaxserve.spec_decode.verify as verify_mod

    cache = {}

    def program(params, kv_caches, tok, seq, spec_rows, num_spec, *rest):
        s = num_spec.shape[0]
        if s not in cache:
            tokens = jnp.full((s, verifier.k + 1), 5, jnp.int32)
            num = jnp.full((s,), (verifier.forced or 0) + 1, jnp.int32)
            out = (None, tokens, num)
            if hasattr(verify_mod, "_packed"):  # this branch's program also returns the packed read back
                out += (verify_mod._packed(tokens, num),)
            jax.block_until_ready(out[1:])
            cache[s] = (out, np)
        return (*cache[s][0], kv_caches)

    return program


def instrument(engine) -> dict[str, float]:
    """Wrap the speculative loop's pieces in timers; returns the dict they add seconds to. Nested pieces (inside
    the verify dispatch, the update) are listed under their parent with a leading '  '."""
    import jaxserve.spec_decode.verify as verify_mod

    split: dict[str, float] = {}
    s, op, spec = engine.scheduler, engine.output_processor, engine.speculator
    v = spec.verifier
    s.schedule = _timer(split, "schedule", s.schedule)
    # The verify dispatch and its parts (module-level names, looked up at call time).
    spec.dispatch = _timer(split, "verify dispatch (all)", spec.dispatch)
    verify_mod.build_step_inputs = _timer(split, "  build_step_inputs", verify_mod.build_step_inputs)
    verify_mod.pack_inputs = _timer(split, "  pack_inputs", verify_mod.pack_inputs)
    verify_mod._rows_metadata = _timer(split, "  _rows_metadata", verify_mod._rows_metadata)
    sm = verify_mod.SamplingMetadata
    from_seqs = sm.from_seqs
    sm.from_seqs = _timer(split, "  SamplingMetadata.from_seqs", from_seqs)
    programs = v._programs
    fake = _fake_program(v) if FAKE_DEVICE else None

    class TimedPrograms(dict):
        def get(self, key, default=None):
            p = dict.get(self, key, default)
            if p is not None and fake is not None:
                p = fake
            return None if p is None else _timer(split, "  jitted call (launch)", p)

    v._programs = TimedPrograms(programs)
    # The read back: first the wait for the device, then the copy and the Python lists.
    fetch = v.fetch

    def timed_fetch(handle):
        t0 = time.perf_counter()
        jax.block_until_ready((getattr(handle, "tokens", None), getattr(handle, "num_emitted", None)))
        split["  wait for the device"] += time.perf_counter() - t0
        return fetch(handle)

    split["  wait for the device"] = 0.0
    v.fetch = _timer(split, "  read back (verifier.fetch)", timed_fetch)
    spec.fetch = _timer(split, "fetch (all: wait, read, stats)", spec.fetch)
    s.update_from_output = _timer(split, "update_from_output", s.update_from_output)
    s.kv.free_tail = _timer(split, "  kv.free_tail", s.kv.free_tail)
    s.kv.cache_full_blocks = _timer(split, "  kv.cache_full_blocks", s.kv.cache_full_blocks)
    op.process = _timer(split, "output_processor.process", op.process)
    spec.propose = _timer(split, "propose (ngram)", spec.propose)
    return split


def run_once(llm, prompt, sp) -> tuple[dict, dict]:
    engine = llm.llm_engine
    split = instrument(engine)
    engine.loop_time.update(steps=0, total_s=0.0, wait_s=0.0, propose_s=0.0)
    engine.add_request("p", prompt, sp)
    while engine.has_unfinished_requests():
        engine.step()
    return split, dict(engine.loop_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--accept", type=int, default=3, help="forced acceptance length")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--stat", choices=("min", "median"), default="min",
                    help="per piece, over the runs: min is the least disturbed by other load on a shared machine")
    ap.add_argument("--model", default=None, help="a checkpoint instead of the tiny random Llama (GPU runs)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--layers", type=int, default=None,
                    help="the tiny model with this many layers (the jitted call's cost grows with its arrays)")
    ap.add_argument("--fake-device", action="store_true",
                    help="skip the verify program (fixed outputs already on the device): the host's work alone, "
                    "steady on a loaded machine")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, help="also cProfile one run; print its top N functions")
    args = ap.parse_args()

    global FAKE_DEVICE
    FAKE_DEVICE = args.fake_device
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "forced_acceptance_length": args.accept}
    if args.model:
        llm = LLM(args.model, load_format=args.load_format, max_model_len=1024, speculative_config=spec)
    else:
        path = checkpoint("llama_gqa")
        if args.layers:
            import tempfile

            from tiny_models import make_tiny_checkpoint

            path = make_tiny_checkpoint(tempfile.mkdtemp(), "llama_gqa", num_hidden_layers=args.layers)
        llm = LLM(
            path, dtype="float32", max_model_len=512, max_num_seqs=8, block_size=16,
            compilation_cache_dir="", use_tqdm_on_load=False, speculative_config=spec,
        )  # fmt: skip
    vocab = llm.llm_engine.text_config.vocab_size
    prompt = {"prompt_token_ids": [(7 * j) % (vocab - 2) + 2 for j in range(args.prompt_len)]}
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)  # warm: every shape compiled
    engine = llm.llm_engine
    originals = {}  # undo the wrappers between runs (instrument wraps the bound methods again)
    for name in ("schedule", "update_from_output"):
        originals[("s", name)] = getattr(engine.scheduler, name)

    runs = []
    import jaxserve.spec_decode.verify as verify_mod

    saved_mod = {n: getattr(verify_mod, n) for n in ("build_step_inputs", "pack_inputs", "_rows_metadata")}
    saved_from_seqs = verify_mod.SamplingMetadata.from_seqs
    for _ in range(args.repeats):
        # Fresh wrappers each run: drop the instance attributes the last run set, restore the module's names.
        for obj in (engine.scheduler, engine.scheduler.kv, engine.output_processor, engine.speculator,
                    engine.speculator.verifier):  # fmt: skip
            for name in ("schedule", "update_from_output", "free_tail", "cache_full_blocks", "process", "dispatch",
                         "fetch", "propose"):  # fmt: skip
                obj.__dict__.pop(name, None)
        if isinstance(engine.speculator.verifier._programs, dict):
            engine.speculator.verifier._programs = dict(engine.speculator.verifier._programs)
        for n, f in saved_mod.items():
            setattr(verify_mod, n, f)
        verify_mod.SamplingMetadata.from_seqs = saved_from_seqs
        runs.append(run_once(llm, prompt, sp))

    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        engine.add_request("prof", prompt, sp)
        while engine.has_unfinished_requests():
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    steps = runs[0][1]["steps"]
    stat = min if args.stat == "min" else statistics.median
    med = {label: stat(r[0][label] for r in runs) / steps * 1e3 for label in runs[0][0]}
    total = stat(r[1]["total_s"] - r[0]["  wait for the device"] for r in runs) / steps * 1e3 + med["  wait for the device"]
    wait = med["  wait for the device"]
    top = sum(v for label, v in med.items() if not label.startswith(" "))
    print(f"k={args.k} accept={args.accept} steps={steps} tokens/step={args.new_tokens / steps:.2f} "
          f"step={total:.3f} ms  host={total - wait:.3f} ms  (wait for the device {wait:.3f} ms)")  # fmt: skip
    launch = med.get("  jitted call (launch)", 0.0)
    print(f"  host without the jitted call: {total - wait - launch:.3f} ms (on CPU the call sometimes runs the step "
          "itself: compare this line)")
    for label, ms in med.items():
        print(f"  {label:34s} {ms:7.3f} ms/step")
    print(f"  {'engine, other':34s} {total - top:7.3f} ms/step")


if __name__ == "__main__":
    main()

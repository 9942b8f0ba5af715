"""Shared helpers for engine tests: tiny checkpoints built once per session, small engines over them."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import jax

from tiny_models import VARIANTS, make_tiny_checkpoint

_ROOT = tempfile.mkdtemp(prefix="jaxserve-tiny-")


@contextlib.contextmanager
def fresh_compiles():
    """Inside, programs compile for real: no reads from JAX's persistent compilation cache, which earlier tests
    fill. XLA:CPU cannot serialize again an executable it loaded from that cache (the copy lacks its fusions'
    code: "Function ... not found" when run), and the executable-store tests store what they compile."""
    from jax._src import compilation_cache  # reset_cache: is_cache_used() remembers its first answer

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


@functools.lru_cache(maxsize=None)
def checkpoint(variant: str) -> str:
    arch, overrides = VARIANTS[variant]
    path = os.path.join(_ROOT, variant)
    make_tiny_checkpoint(path, arch, **overrides)
    return path


def run_cache_dir() -> str:
    """The compilation cache of this test run: `make test` and .ci/run point JAXSERVE_CACHE_DIR at a fresh
    directory, so engines that compile the same programs (the tiny checkpoints' steps, both replicas of a DP
    engine) compile them once per run; without it (pytest run by hand) "" keeps tests out of the user's cache."""
    return os.environ.get("JAXSERVE_CACHE_DIR", "")


def small_engine_kwargs(**overrides):
    """fp32, short context, tiny budget (forces chunked prefill), small blocks, steps compiled on first use.

    precompile="none": a test runs a few of the engine's step shapes, and compiling all of them at start-up
    took ~40% of the engine tests' time (test_engine_parity + test_engine_features: 139 -> 80 s on 2 cores).
    Tests of start-up compiling ask for it (precompile="auto").
    """
    kw = dict(
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=4,
        compilation_cache_dir=run_cache_dir(),
        use_tqdm_on_load=False,
        precompile="none",
    )
    kw.update(overrides)
    if jax.default_backend() != "cpu" and "num_gpu_blocks_override" not in kw:
        # On a GPU a cache is sized from free device memory (0.9 of it), so the second engine a test builds
        # in one process would find none left: size it as on CPU (every sequence at full length, + null block).
        kw["num_gpu_blocks_override"] = kw["max_num_seqs"] * -(-kw["max_model_len"] // kw["block_size"]) + 1
    return kw


def speculative_engine(speculative_config: dict, target: str = "llama_gqa", **kw):
    """A small engine over a tiny target with ``speculative_config``, compiling on first use; with a draft model or
    an EAGLE head, rounds fed by the verify step are on (on CPU off by default: jaxserve.spec_decode.speculator)."""
    from jaxserve import LLM

    llm = LLM(checkpoint(target), **small_engine_kwargs(speculative_config=speculative_config,
                                                        **{"precompile": "none", **kw}))
    if speculative_config["method"] != "ngram":
        llm.llm_engine.speculator.fed_rounds = True
    return llm


def generate(llm, prompts, params, speculate: bool = True) -> list:
    """``llm.generate``; ``speculate=False`` switches the engine's speculator off for the call: the plain engine,
    on the same weights and cache, which speculation must match token for token."""
    engine = llm.llm_engine
    saved = engine.speculator
    engine.speculator = saved if speculate else None
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.speculator = saved


def completions(outs) -> list:
    """Per request, each completion's (token ids, text, finish reason): what exactness tests compare."""
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def check_priming_writes_no_kv(llm, monkeypatch, prompts, params) -> None:
    """Accelerators run every start-up verify and round program once on padding at start-up (``prime``). Forced
    here on CPU over one small shape each, after real requests filled the caches: every cache (the target's, its
    hidden-state store, the draft's or the EAGLE head's) keeps its bits, the draft's step count is unchanged, and
    speculation stays exact."""
    import jax
    import numpy as np

    from jaxserve.spec_decode.draft_program import RoundPrograms

    monkeypatch.setattr(RoundPrograms, "shapes", lambda self: [(4, self.runner.width_buckets[0])])
    spec = llm.llm_engine.speculator
    verifier, proposer = spec.verifier, spec.draft
    monkeypatch.setattr(type(verifier), "startup_shapes", lambda self: [
        (4, self.runner.width_buckets[0], self.rows_for(4), pure) for pure in (False, True)])
    plain = completions(generate(llm, prompts, params, speculate=False))

    def caches():
        own = getattr(proposer, "runner", None)  # a draft model's runner; an EAGLE head's cache is the programs'
        held = [llm.llm_engine.runner.kv_caches, own.kv_caches if own is not None else proposer.programs.kv_caches]
        return [np.asarray(x) for x in jax.tree.leaves(held)]

    before, steps = caches(), getattr(getattr(proposer, "runner", None), "num_steps", None)
    for programs in (verifier, proposer.programs, proposer.fed):
        programs.warmup()  # compiles the shape (on CPU it does not prime)
        programs.prime()
    after = caches()
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
    assert getattr(getattr(proposer, "runner", None), "num_steps", None) == steps
    assert completions(generate(llm, prompts, params)) == plain

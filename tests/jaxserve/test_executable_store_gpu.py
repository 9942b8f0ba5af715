"""A warm start on an accelerator loads its step programs from the executable store, with the same tokens.

GPU/TPU only: XLA:CPU cannot run deserialized executables (see jaxserve.executable_store).
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="the executable store serves accelerators only")


def test_second_start_loads_every_step_program(tmp_path):
    kw = small_engine_kwargs(compilation_cache_dir=str(tmp_path / "cache"), precompile="all")
    prompts = [{"prompt_token_ids": np.random.default_rng(n).integers(2, 500, size=n).tolist()} for n in (5, 37, 90)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    cold = LLM(checkpoint("llama_gqa"), **kw)
    shapes = len(cold.llm_engine.runner.compiled_shapes)
    assert cold.llm_engine.runner.num_loaded_programs == 0
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    del cold
    gc.collect()

    warm = LLM(checkpoint("llama_gqa"), **kw)
    assert warm.llm_engine.runner.num_loaded_programs == shapes > 0
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)] == want

"""Engine integration: attention_backend='xla' and 'pallas' (interpret mode on CPU) give the reference's greedy
tokens, which equal HF transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import hf_greedy

from jaxserve import LLM, SamplingParams


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen3_qknorm"])
def test_pallas_backend_matches_reference_and_hf(variant):
    path = checkpoint(variant)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    kw = small_engine_kwargs(max_num_batched_tokens=64)
    want = [hf_greedy(path, p, 6) for p in prompts]
    for backend in ("reference", "xla", "pallas"):
        llm = LLM(path, attention_backend=backend, **kw)
        assert llm.llm_engine.runner.runner_config.attention_backend == backend
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, backend
        if backend == "pallas":  # pure-decode steps ran their own program (no prefill kernel)
            assert any(decode_only for *_, decode_only in llm.llm_engine.runner.compiled_shapes)


@pytest.mark.slow  # ~30 s: the pallas engine runs interpreted on CPU
def test_fp8_kv_cache_same_tokens_in_pallas_and_xla():
    """Over an fp8 cache both backends read the same dequantized values: the same greedy tokens. e5m2, the
    coarser format, where a wrong scale or rounding would show first; the kernel tests cover e4m3 too."""
    path = checkpoint("llama_gqa")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    kw = small_engine_kwargs(max_num_batched_tokens=64, kv_cache_dtype="fp8_e5m2")
    got = {}
    for backend in ("xla", "pallas"):
        llm = LLM(path, attention_backend=backend, **kw)
        assert llm.llm_engine.runner.kv_caches[0][0].dtype.name.startswith("float8")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got[backend] = [o.outputs[0].token_ids for o in outs]
    assert got["pallas"] == got["xla"], got


class _Oracle:
    """Proposes the reference continuation with proposal ``len(tokens) % 10`` corrupted (none when >= k): every
    acceptance length 0..k comes up, whatever the random model predicts."""

    def __init__(self, refs):
        self.refs = refs

    def propose(self, tokens, k, key=None):  # NgramProposer's interface (key: its per-request buffer, unused here)
        for full in self.refs:
            if full[: len(tokens)] == tokens:
                proposal = list(full[len(tokens) : len(tokens) + k])
                bad = len(tokens) % 10
                if bad < len(proposal):
                    proposal[bad] = (proposal[bad] + 1) % 500 + 2
                return proposal
        return []

    def retain(self, keys):
        pass


def test_pure_verify_steps_run_the_decode_kernel_exactly():
    """k = 8: a verify step without prompt chunks gives each sequence 1 + k query tokens, which its own program
    hands to the decode kernel alone (AttentionMetadata.decode_query_len): 16 query tokens a program instead of
    the 8 that fill the smallest tile for this model's 2 query heads a KV head. Greedy tokens with speculation
    equal those without, at every acceptance length, while another request's prompt chunks make some verify
    steps mixed."""
    path = checkpoint("llama_gqa")
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    llm = LLM(path, attention_backend="pallas",
              **small_engine_kwargs(max_num_batched_tokens=64, precompile="none", speculative_config=spec,
                                    enable_prefix_caching=False))  # the second run prefills in chunks again
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(2, 500, size=n).tolist()} for n in (6, 40, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    engine = llm.llm_engine
    speculator, engine.speculator = engine.speculator, None
    plain = llm.generate(prompts, params, use_tqdm=False)
    engine.speculator = speculator
    speculator.ngram = _Oracle([p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, plain)])
    spec_outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec_outs] == [o.outputs[0].token_ids for o in plain]
    shapes = set(speculator.verifier._programs)
    assert any(pure for *_, pure in shapes) and any(not pure for *_, pure in shapes), shapes
    assert 0 < speculator.stats.num_accepted_tokens < speculator.stats.num_draft_tokens

"""The embedded default model (SmolLM2-135M-Instruct GGUF) answers a simple factual question."""

from __future__ import annotations

from engine_fixtures import run_cache_dir

from jaxserve import LLM, SamplingParams


def test_default_model_knows_the_capital_of_france():
    llm = LLM(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False,
              precompile="none")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    text = out.outputs[0].text
    assert "Paris" in text, text
    assert out.outputs[0].finish_reason in ("stop", "length")

"""The host loop's shortcuts change no output: a final_only request (LLM.generate's kind), whose text is only built
when it ends, gets exactly the tokens and text a streamed one gets, also when aborted half way."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs()).llm_engine


def _ids(n, seed):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def _params(kind):
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=kind),
        SamplingParams(temperature=1.0, seed=3, max_tokens=15, output_kind=kind),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["e"], output_kind=kind),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, output_kind=kind),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, output_kind=kind),
    ]


def _finals(engine, kind, abort_after=None):
    """Run the requests to the end (or abort them all after ``abort_after`` steps); the last output of each."""
    last = {}
    for i, sp in enumerate(_params(kind)):
        engine.add_request(f"{kind}{i}", {"prompt_token_ids": _ids(7 + i, i)}, sp)
    steps = 0
    while engine.has_unfinished_requests():
        if steps == abort_after:
            for out in engine.abort_request(sorted({k for k in engine.output_processor.groups})):
                last[out.request_id] = out
            break
        for out in engine.step():
            last[out.request_id] = out
        steps += 1
    while engine.step():  # drain the step in flight
        pass
    return {
        rid[len(kind):]: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs is not None) for c in o.outputs]
        for rid, o in last.items()
    }  # fmt: skip


def test_final_only_outputs_equal_streamed_ones(engine):
    assert _finals(engine, "final_only") == _finals(engine, "cumulative")


def test_final_only_abort_keeps_the_text_so_far(engine):
    streamed = _finals(engine, "cumulative", abort_after=6)
    final = _finals(engine, "final_only", abort_after=6)
    assert final == streamed
    assert any(text for outs in final.values() for _, text, *_ in outs)  # the check saw some text

"""The asynchronous step loop on a tiny checkpoint: the same outputs as one step at a time, exactly.

Step N+1 is dispatched before step N's tokens are read, so stops are seen one step late. These tests
run the same requests with async scheduling on and off (one engine, the switch flipped between runs)
and check that tokens, text, finish reasons and logprobs are identical, across stop tokens, stop strings,
max_tokens, min_tokens, n > 1 with seeds, penalties (which read the in-flight token first), aborts with
a step in flight, and preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs())


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def _run(llm, prompts, params, async_on):
    engine = llm.llm_engine
    engine.async_scheduling = async_on
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.async_scheduling = True


def _summary(outs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          None if c.logprobs is None else [{t: round(lp.logprob, 5) for t, lp in e.items()} for e in c.logprobs])
         for c in o.outputs]
        for o in outs
    ]  # fmt: skip


def test_async_equals_sync_across_stops_and_sampling(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate([{"prompt_token_ids": _ids(11, 1)}], greedy, use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[5]  # a stop token in the middle of the run: seen with step N+1 in flight
    prompts, params = [], []
    for i, sp in enumerate([
        greedy,
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[base.text[6:9]]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, min_tokens=8, stop_token_ids=[stop_tok]),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5, max_tokens=9, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True),
    ]):  # fmt: skip
        prompts.append({"prompt_token_ids": _ids(11, 1) if i < 5 else _ids(7 + 5 * i, i)})
        params.append(sp)
    sync = _summary(_run(llm, prompts, params, async_on=False))
    overlapped = _summary(_run(llm, prompts, params, async_on=True))
    assert overlapped == sync
    stopped = sync[1][0]
    assert stopped[0][-1] == stop_tok and stopped[2] == "stop" and len(stopped[0]) == 6
    by_string = sync[2][0]  # the stop string is found with later steps in flight; their tokens are dropped
    assert by_string[2] == "stop" and isinstance(by_string[3], str) and len(by_string[0]) < 24


def test_each_request_alone_equals_batched_under_overlap(llm):
    prompts = [{"prompt_token_ids": _ids(n, n)} for n in (3, 19, 40, 8)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (17, 5, 9, 30)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone


def test_abort_with_a_step_in_flight(llm):
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {f"abort-{i}": _ids(6 + i, 40 + i) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    finals = {}
    for _ in range(3):
        for out in engine.step():
            finals[out.request_id] = out
    assert engine._in_flight is not None  # a step is dispatched and not yet read
    (aborted,) = engine.abort_request("abort-1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    seen = len(aborted.outputs[0].token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "abort-1"
            finals[out.request_id] = out
    engine.step()  # reads back whatever is still in flight
    assert engine.scheduler.kv_cache_usage == 0.0
    for rid in ("abort-0", "abort-2"):
        alone = llm.generate([{"prompt_token_ids": prompts[rid]}], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert finals[rid].outputs[0].token_ids == alone
    assert seen < 20


def test_preemption_under_overlap_keeps_output():
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(num_gpu_blocks_override=30, max_num_batched_tokens=64))
    prompts = [{"prompt_token_ids": _ids(20 + i, 70 + i)} for i in range(5)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync = [o.outputs[0].token_ids for o in _run(llm, prompts, sp, async_on=False)]
    before = llm.llm_engine.get_stats().num_preemptions
    overlapped = [o.outputs[0].token_ids for o in _run(llm, prompts, sp, async_on=True)]
    assert llm.llm_engine.get_stats().num_preemptions > before > 0
    assert overlapped == sync


def test_deferred_text_built_while_the_device_computes(llm, monkeypatch):
    """On accelerators the host detokenizes deferred requests (LLM.generate's, no stop strings or logprobs) while
    it waits for a step, not all at once when they finish. Forced on here, with the step always "computing":
    the texts, tokens and finish reasons equal those built at the finish, an abort's included."""
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": _ids(n, n)} for n in (5, 17, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (14, 6, 21)]
    at_finish = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert all(o[0][1] for o in at_finish)  # the tiny checkpoint has a tokenizer: every output has text

    caught = []
    original = engine.output_processor._catch_up
    monkeypatch.setattr(engine.output_processor, "_catch_up", lambda state: (caught.append(state), original(state)))
    monkeypatch.setattr(engine.runner, "ready", lambda handle: False)
    monkeypatch.setattr(engine, "_detokenize_while_waiting", True)
    assert _summary(llm.generate(prompts, params, use_tqdm=False)) == at_finish
    assert len(caught) > len(prompts)  # text was built step by step, not only at the end
    assert engine.output_processor.deferred_text == {}  # finished requests leave nothing behind

    sp = params[2]
    engine.add_request("deferred-abort", prompts[2], sp)
    for _ in range(6):
        engine.step()
    (aborted,) = engine.abort_request("deferred-abort")
    engine.step()
    got = aborted.outputs[0]
    assert got.finish_reason == "abort" and 0 < len(got.token_ids) < sp.max_tokens
    assert got.text == llm.get_tokenizer().decode(got.token_ids)
    assert engine.output_processor.deferred_text == {}

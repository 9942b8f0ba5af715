"""Speculative decoding on a tiny checkpoint: greedy output with speculation is greedy output without, token for
token, across stop tokens, stop strings, max_tokens, n > 1, logprobs, chunked prefill (a 32-token budget),
prefix caching and preemption. One engine; the speculator is switched off for the reference run, so both runs
share compiled programs. Besides the n-gram proposer, an "oracle" proposer (the reference continuation with one
token corrupted at a varying place) drives every acceptance length 0..k through the same verify step.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_fixtures import checkpoint, fresh_compiles, generate, run_cache_dir, small_engine_kwargs

from jaxserve import LLM, SamplingParams

K = 3


@pytest.fixture(scope="module")
def llm():
    spec = {"method": "ngram", "num_speculative_tokens": K}
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs(precompile="none", speculative_config=spec))


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def _repetitive(n, seed):
    base = _ids(n, seed)
    return base + base[: n // 2] + base  # prompt lookup finds matches


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _logprobs(outs):
    return [[c.logprobs for c in o.outputs] for o in outs]


class _Oracle:
    """Proposes the reference continuation, corrupting proposal ``len(tokens) % (K + 2)`` (none if >= K)."""

    def __init__(self, refs):
        self.refs = refs  # list of full reference sequences (prompt + output)

    def propose(self, tokens, k, key=None):  # NgramProposer's interface (key: its per-request buffer, unused here)
        for full in self.refs:
            if full[: len(tokens)] == tokens:
                proposal = list(full[len(tokens) : len(tokens) + k])
                bad = len(tokens) % (K + 2)
                if bad < len(proposal):
                    proposal[bad] = (proposal[bad] + 1) % 500 + 2
                return proposal
        return []

    def retain(self, keys):
        pass


def _params_mix(stop_tok, stop_str):
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=30, **greedy),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=30, stop=[stop_str], **greedy),
        SamplingParams(max_tokens=7, **greedy),  # max_tokens ends inside a step's proposals
        SamplingParams(n=2, max_tokens=13, logprobs=2, **greedy),
        SamplingParams(max_tokens=20, min_tokens=6, temperature=0, stop_token_ids=[stop_tok]),
        SamplingParams(max_tokens=12, repetition_penalty=1.2, **greedy),  # penalties: no proposals, still exact
    ]


def _prompts_and_params(llm):
    prompt = _repetitive(12, 1)
    base = generate(llm, [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                     speculate=False)[0].outputs[0]
    params = _params_mix(base.token_ids[9], base.text[12:15])
    prompts = [{"prompt_token_ids": prompt if i < 3 else _repetitive(5 + 3 * i, i)} for i in range(len(params))]
    return prompts, params


def _check_same(llm, prompts, params):
    plain = generate(llm, prompts, params, speculate=False)
    spec = generate(llm, prompts, params)
    assert _summary(spec) == _summary(plain)
    for a_out, b_out in zip(_logprobs(spec), _logprobs(plain)):
        for a, b in zip(a_out, b_out):
            if a is None:
                assert b is None
                continue
            assert [sorted(e) for e in a] == [sorted(e) for e in b]
            for ea, eb in zip(a, b):
                for t in ea:
                    assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=1e-4)
                    assert ea[t].rank == eb[t].rank
    return plain, spec


def test_ngram_greedy_equals_plain_across_stops(llm):
    prompts, params = _prompts_and_params(llm)
    stats = llm.llm_engine.speculator.stats
    before = stats.num_accepted_tokens
    plain, _ = _check_same(llm, prompts, params)
    assert stats.num_accepted_tokens > before  # the lookup found something the model agreed with
    assert plain[1].outputs[0].finish_reason == "stop" and plain[2].outputs[0].stop_reason == params[2].stop[0]


def test_every_acceptance_length_is_exact(llm):
    prompts, params = _prompts_and_params(llm)
    plain = generate(llm, prompts, params, speculate=False)
    spec_ = llm.llm_engine.speculator
    saved, spec_.ngram = spec_.ngram, _Oracle([p["prompt_token_ids"] + c.token_ids for p, o in zip(prompts, plain)
                                                for c in o.outputs])
    per_pos_before = list(spec_.stats.accepted_per_pos)
    drafts_before = spec_.stats.num_drafts
    try:
        _check_same(llm, prompts, params)
    finally:
        spec_.ngram = saved
    drafts = spec_.stats.num_drafts - drafts_before
    per_pos = [a - b for a, b in zip(spec_.stats.accepted_per_pos, per_pos_before)]
    # Corruption at every place: some drafts accept 0, some 1, 2, and some all K proposals.
    assert per_pos[0] < drafts and 0 < per_pos[K - 1] < per_pos[0]


def test_preemption_and_prefix_caching(llm):
    spec = {"method": "ngram", "num_speculative_tokens": K}
    small = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(num_gpu_blocks_override=40, precompile="none",
                                                               speculative_config=spec))
    shared = _repetitive(10, 7)
    prompts = [{"prompt_token_ids": shared + _ids(3 + i, 20 + i)} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    plain = generate(small, prompts, params, speculate=False)
    engine = small.llm_engine
    preempted, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    spec = generate(small, prompts, params)
    assert _summary(spec) == _summary(plain)
    assert engine.scheduler.num_preemptions > preempted and engine.scheduler.prefix_cache_hits > hits
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": _repetitive(9, 4)}
    alone = _summary(generate(llm, [prompt], sp))
    batched = _summary(generate(llm, [prompt, {"prompt_token_ids": _ids(20, 5)}], sp))
    assert batched[0] == alone[0] and len(alone[0][0][0]) == 16


@pytest.mark.slow
def test_default_model_ngram_greedy_is_exact():
    """The real default model (SmolLM2-135M) editing a code snippet: n-gram proposals are mostly right, and the
    text is greedy decoding's exactly."""
    code = "def add(a, b):\n    total = a + b\n    return total\n\nprint(add(2, 3))\n"
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, compilation_cache_dir=run_cache_dir(),
              use_tqdm_on_load=False, speculative_config=spec, precompile="none")
    messages = [{"role": "user", "content": "Rename the function add to plus and show the whole code:\n\n" + code}]
    sp = SamplingParams(temperature=0, max_tokens=40)
    engine = llm.llm_engine
    spec_out = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    saved, engine.speculator = engine.speculator, None
    plain = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    engine.speculator = saved
    assert spec_out.token_ids == plain.token_ids and spec_out.text == plain.text
    assert saved.stats.mean_acceptance_length > 1.5, saved.stats.summary()


def test_verify_programs_are_stored_and_loaded(llm, tmp_path, monkeypatch):
    """A second start loads the verify programs an earlier one compiled (the runner's executable store, which on
    accelerators persists between starts; opened here on CPU too), and they give the same tokens."""
    import dataclasses

    from jaxserve import executable_store
    from jaxserve.spec_decode.verify import VerifyRunner

    monkeypatch.setattr(executable_store.ExecutableStore, "open",
                        classmethod(lambda cls, cache_dir, platform, context: cls(str(tmp_path), context)))
    engine = llm.llm_engine
    runner, spec_ = engine.runner, engine.speculator
    saved_config, saved_verifier = runner.runner_config, spec_.verifier
    runner.runner_config = dataclasses.replace(saved_config, precompile="common")  # one shape: the single stream's
    try:
        with fresh_compiles():  # the cold start compiles what it stores, as on a fresh machine
            cold = VerifyRunner(runner, K)
            cold.warmup()
            warm = VerifyRunner(runner, K)
            warm.warmup()
        assert cold.num_loaded_programs == 0 and warm.num_loaded_programs == len(warm.startup_shapes()) == 1
        assert len(list(tmp_path.glob("verify-k3-*-pure-*.jxe"))) == 1
        spec_.verifier = warm
        prompts, params = _prompts_and_params(llm)
        _check_same(llm, prompts[:1], params[:1])
        assert warm.num_lazy_compiles == 0  # the single stream ran the loaded program only
    finally:
        runner.runner_config, spec_.verifier = saved_config, saved_verifier


def test_streamed_outputs_with_deferred_processing(llm):
    """With speculation a step's output processing runs during the next verify step (LLMEngine._speculative_step):
    streamed (cumulative) outputs still end as the plain engine's, across a stop token, a stop string found a step
    late and max_tokens; an abort between steps includes the last step's tokens, and its final output is the last."""
    prompts, params = _prompts_and_params(llm)
    prompts, params = prompts[:4], params[:4]  # no stop / stop token / stop string / max_tokens inside a step
    plain = generate(llm, prompts, params, speculate=False)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", p, sp)  # cumulative: an output every step
    finals, deferred_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals  # nothing after a final output
            if out.finished:
                finals[out.request_id] = out
        deferred_steps += engine._deferred is not None
    assert deferred_steps > 3
    assert _summary([finals[f"s{i}"] for i in range(4)]) == _summary(plain)

    engine.add_request("a", prompts[0], params[0])
    for _ in range(4):
        engine.step()
    assert engine._deferred is not None
    tokens = list(engine.scheduler.requests["a"].output_token_ids)
    (aborted,) = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].token_ids == tokens
    assert plain[0].outputs[0].text.startswith(aborted.outputs[0].text) and aborted.outputs[0].text
    while engine.has_unfinished_requests():
        assert engine.step() == []  # the held output of the aborted request is dropped


def test_verify_programs_launched_kernel_by_kernel(llm, monkeypatch):
    """Verify programs compiled as a GPU compiles them (no command buffers: jaxserve.launch_mode) give the same
    tokens, and are stored under their own names."""
    from jaxserve import launch_mode
    from jaxserve.spec_decode.verify import VerifyRunner

    monkeypatch.setattr(launch_mode, "compiler_options", lambda platform, host_bound: {
        "xla_gpu_enable_command_buffer": ""} if host_bound else None)
    # A speculative engine's plain steps launch after reading the last step too: they go kernel by kernel as well.
    assert llm.llm_engine.runner.runner_config.host_bound_steps
    spec_ = llm.llm_engine.speculator
    saved = spec_.verifier
    spec_.verifier = verifier = VerifyRunner(llm.llm_engine.runner, K)
    try:
        assert verifier._options == {"xla_gpu_enable_command_buffer": ""}
        assert verifier._store_name((16, 4, 16, True)).endswith("-pure-nocb")
        prompts, params = _prompts_and_params(llm)
        _check_same(llm, prompts, params)  # stops, max_tokens mid-proposal, n = 2 with logprobs, penalties
        assert verifier.num_lazy_compiles >= 1  # its own programs ran, compiled with the option
    finally:
        spec_.verifier = saved

"""Engine features on a tiny checkpoint: sampling seeds, n>1, stop strings, logprobs, errors, compiles."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from tiny_models import hf_logits

from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # Start-up compiles on ("auto"), unlike small_engine_kwargs' default: the priming tests below need them.
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs(precompile="auto"))


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = {"prompt_token_ids": _ids(9)}
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": _ids(n, seed=n)} for n in (3, 17, 30)]
    batch = llm.generate(others[:2] + [p] + others[2:], [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [sp] + [SamplingParams(temperature=0.7, max_tokens=5)], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = llm.generate([p], sp.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_samples_share_prompt_and_differ(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": _ids(12)}], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([{"prompt_token_ids": _ids(12)}], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_match_hf_log_softmax(llm):
    path = checkpoint("llama_gqa")
    prompt = _ids(10)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=5), use_tqdm=False)[0]
    comp = out.outputs[0]
    ids = prompt + comp.token_ids
    logits = hf_logits(path, ids)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    for step, entry in enumerate(comp.logprobs):
        row = logp[len(prompt) - 1 + step]
        tok = comp.token_ids[step]
        assert entry[tok].rank == 1
        assert abs(entry[tok].logprob - row[tok]) < 1e-4
        top5 = np.argsort(-row)[:5]
        assert set(top5) <= set(entry)
        for t in top5:
            assert abs(entry[int(t)].logprob - row[t]) < 1e-4


def test_stop_strings_cut_text(llm):
    prompt = "hello world"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    text = full.text
    if len(text) < 4:
        pytest.skip("the tiny model produced too little text to cut")
    stop = text[2:4]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate([{"prompt_token_ids": _ids(5)}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    stop_tok = out.outputs[0].token_ids[1]
    out2 = llm.generate([{"prompt_token_ids": _ids(5)}], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out2.outputs[0].finish_reason == "stop" and out2.outputs[0].stop_reason == stop_tok


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": list(range(2, 200))}, SamplingParams(), "max_model_len"),
        ({"prompt_token_ids": [5, 100000]}, SamplingParams(), "vocabulary"),
    ],
)
def test_bad_prompts_raise_and_engine_goes_on(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(["ok"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_and_unimplemented_options():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(checkpoint("llama_gqa"), max_modle_len=64)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(checkpoint("llama_gqa"), tensor_parallel_size=3)


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == list(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False))


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    sp = SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat(messages, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    tok = llm.get_tokenizer()
    closed = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    assert out.prompt_token_ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                                continue_final_message=True))
    assert len(out.prompt_token_ids) < len(closed)  # no end-of-turn after "hello there": the model continues it
    assert tok.decode(out.prompt_token_ids).endswith("hello there")
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        llm.chat(messages, sp, use_tqdm=False, continue_final_message=True)


def test_chat_renders_tools_through_the_template(llm):
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                   chat_template=template, tools=tools)[0]
    assert "get_weather" in llm.get_tokenizer().decode(out.prompt_token_ids)


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_events: list[str] | None = None  # collecting while a list


def _on_event(name: str, *args, **kwargs) -> None:
    if _events is not None and name in _COMPILE_EVENTS:
        _events.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def _count_compiles():
    """JAX's own monitoring events: every trace and every XLA compile, whichever cache would have served it."""
    global _events
    _events = events = []
    try:
        yield events
    finally:
        _events = None


def test_steady_state_compiles_nothing_new(llm):
    """Every shape this workload reaches was compiled ahead at start-up (precompile, sampler variants
    included): afterwards nothing is traced or compiled again."""
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (1, 4, 15, 31, 60, 90)]
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, max_tokens=m, seed=1) for t, tp, k, m in
              [(0, 1, 0, 5), (1.0, 0.9, 0, 9), (0.8, 1, 20, 3), (0, 1, 0, 30), (1.0, 1, 0, 12), (0.5, 0.5, 5, 7)]]
    with _count_compiles() as events:
        llm.generate(prompts, params, use_tqdm=False)
    assert events == []
    runner = llm.llm_engine.runner
    assert runner.num_lazy_compiles == 0
    # Each start-up compile's seconds, by shape (the runner logs the slowest; the start-up probe prints them).
    assert set(runner.compile_seconds) <= runner.compiled_shapes and min(runner.compile_seconds.values()) > 0
    if not runner.num_loaded_programs:  # (a program loaded from the executable store, accelerators only, has none)
        assert set(runner.compile_seconds) == runner.compiled_shapes


def test_priming_runs_every_start_up_program_once_and_writes_no_kv(llm, monkeypatch):
    """On accelerators the warm-up runs every start-up step program once on padding (``_prime``: kernels
    loaded, command buffers built before the first real step). Here on the CPU, where the warm-up skips it, it is
    called directly: each program runs once, largest first, and the cache is unchanged (padding's writes drop)."""
    runner = llm.llm_engine.runner
    prompt = {"prompt_token_ids": _ids(9, seed=3)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    cache = [np.asarray(c) for c in jax.tree.leaves(runner.kv_caches)]
    calls = []
    for shape, program in list(runner._programs.items()):
        def counted(*args, _shape=shape, _program=program):
            calls.append(_shape)
            return _program(*args)
        monkeypatch.setitem(runner._programs, shape, counted)
    runner._prime(sorted(runner.compiled_shapes))
    assert calls == sorted(runner.compiled_shapes, reverse=True)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(cache, jax.tree.leaves(runner.kv_caches)))
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == before


def test_precompile_none_compiles_on_first_use_with_the_same_tokens(llm):
    """precompile="none" starts with nothing compiled; shapes compile as steps reach them, once, and the
    tokens are those of an engine that compiled everything ahead."""
    lazy = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(precompile="none"))
    assert lazy.llm_engine.info()["compiled_step_shapes"] == 0
    prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (3, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in lazy.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = lazy.llm_engine.runner
    assert runner.num_lazy_compiles == len(runner.compiled_shapes) > 0
    with _count_compiles() as events:  # the same shapes again: nothing new
        lazy.generate(prompts, params, use_tqdm=False)
    assert events == [] and runner.num_lazy_compiles == len(runner.compiled_shapes)


def test_min_tokens_holds_back_stop_tokens(llm):
    """As vLLM: before min_tokens, stop tokens (and EOS) cannot be sampled at all."""
    prompt = {"prompt_token_ids": _ids(6, seed=5)}
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    first = free.outputs[0].token_ids[0]
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[first]), use_tqdm=False)[0]
    toks = held.outputs[0].token_ids
    assert first not in toks[:3]
    assert len(toks) >= 3


def test_dummy_weights_engine_runs():
    """load_format='dummy': random weights from the config alone (benchmarks), same engine path."""
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(load_format="dummy"))
    out = llm.generate([{"prompt_token_ids": _ids(7)}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_dummy_weights_from_a_config_only_directory(tmp_path):
    """A benchmark shape with no tokenizer files: dummy weights still run on token-id prompts."""
    import json
    import shutil

    shutil.copy(f"{checkpoint('llama_gqa')}/config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), **small_engine_kwargs(load_format="dummy"))
    assert llm.get_tokenizer() is None
    out = llm.generate([{"prompt_token_ids": _ids(5)}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, detokenize=False), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

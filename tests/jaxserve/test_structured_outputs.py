"""Structured outputs (SamplingParams.structured_outputs): every output obeys its constraint, unconstrained
requests beside them are untouched, and the paths a request can take (chunked prefill, prefix caching,
preemption, n > 1, TP and DP) keep the constraint. The tiny random model writes nonsense, so the checks are on the
form: a choice, a full regex match, JSON that parses and fits its schema."""

from __future__ import annotations

import json
import re

import jax
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs

from jaxserve import LLM, SamplingParams
from jaxserve.structured_output import GrammarCompiler, StructuredOutputsParams

CHOICES = ["Paris", "London", "Rome"]
REGEX = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": CHOICES},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "count", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The capital of France is", "My phone number is", "x" * 60]  # the last one spans chunks (budget 32)


def _check_json(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "count", "ok"}
    assert value["city"] in CHOICES and 0 <= value["count"] <= 99 and isinstance(value["ok"], bool)


CONSTRAINTS = {
    "choice": ({"choice": CHOICES}, lambda t: t in CHOICES),
    "regex": ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "json": ({"json": SCHEMA}, lambda t: _check_json(t) is None),
    "grammar": ({"grammar": 'start: "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
}


def _generate(llm: LLM, kind: str, prompts=PROMPTS, **params):
    so, _ = CONSTRAINTS[kind]
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 48, "structured_outputs": so, **params})
    return llm.generate(prompts, sp, use_tqdm=False)


def _assert_obeys(kind: str, outs) -> None:
    _, check = CONSTRAINTS[kind]
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            assert check(c.text), (kind, c.text)


@pytest.fixture(scope="module")
def llm():
    return LLM(checkpoint("llama_gqa"), **small_engine_kwargs())


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_outputs_obey_the_constraint(llm, kind):
    _assert_obeys(kind, _generate(llm, kind))


def test_json_object_and_free_whitespace(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json_object": True})
    for out in llm.generate(PROMPTS[:2], sp, use_tqdm=False):
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    loose = {"json": SCHEMA, "disable_any_whitespace": False}
    sp = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=loose)
    for out in llm.generate(PROMPTS[:2], sp, use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            _check_json(out.outputs[0].text)


def test_sampled_outputs_and_n_samples(llm):
    outs = _generate(llm, "choice", temperature=1.0, seed=3, n=4)
    _assert_obeys("choice", outs)
    assert all(len(o.outputs) == 4 for o in outs)
    outs = _generate(llm, "json", prompts=PROMPTS[:2], temperature=1.0, seed=5, n=2)
    _assert_obeys("json", outs)


def test_unconstrained_requests_beside_them_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs={"regex": REGEX})
    mixed = llm.generate(PROMPTS * 2, [plain] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    _assert_obeys("regex", mixed[3:])


def test_masks_wait_for_the_token_in_flight(llm, monkeypatch):
    """The asynchronous loop launches a grammar batch's model before the step in flight is read back, and fills the
    masks and launches the sampler after: the samples equal the synchronous loop's (seeded, n=2)."""
    runner = llm.llm_engine.runner
    deferred = []
    monkeypatch.setattr(runner, "sample_deferred", lambda h, f=runner.sample_deferred: (deferred.append(h), f(h)))
    outs = _generate(llm, "json", prompts=PROMPTS[:2], temperature=1.0, seed=7, n=2)
    assert deferred
    sync = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(async_scheduling=False))
    reference = _generate(sync, "json", prompts=PROMPTS[:2], temperature=1.0, seed=7, n=2)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in reference]
    _assert_obeys("json", outs)


def test_greedy_takes_the_best_allowed_token(llm):
    """With a choice of single tokens, greedy picks the one the model ranks highest among them: the same token an
    equal logit_bias on just those tokens makes the argmax."""
    tok = llm.get_tokenizer()
    words = [w for w in ("a", "b", "c", "d", "e") if len(tok.encode(w, add_special_tokens=False)) == 1]
    ids = [tok.encode(w, add_special_tokens=False)[0] for w in words]
    assert len(ids) >= 3
    for prompt in PROMPTS:
        biased = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={i: 100.0 for i in ids})
        best = llm.generate([prompt], biased, use_tqdm=False)[0].outputs[0].token_ids[0]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={
            "choice": words}), use_tqdm=False)[0].outputs[0]
        assert out.token_ids[0] == best and out.text == tok.decode([best])


def test_prefix_caching_and_preemption():
    # 24 blocks of 4 tokens for three prompts and their outputs: requests are preempted and recomputed, and the
    # second round reads the first's cached prompt blocks.
    llm = LLM(checkpoint("llama_gqa"), **small_engine_kwargs(num_gpu_blocks_override=24, enable_prefix_caching=True))
    for kind in ("json", "regex"):
        _assert_obeys(kind, _generate(llm, kind, prompts=PROMPTS * 2))
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_tensor_parallel(llm):
    reference = _generate(llm, "json")
    tp = LLM(checkpoint("llama_gqa"), tensor_parallel_size=2, **small_engine_kwargs())
    outs = _generate(tp, "json")
    _assert_obeys("json", outs)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in reference]


def test_data_parallel(llm):
    """Two replica processes: the params travel by pickle, each replica compiles its requests' grammars, and the
    router compiles them first, so a bad constraint is refused before anything is sent."""
    reference = _generate(llm, "json")
    dp = LLM(checkpoint("llama_gqa"), data_parallel_size=2, **small_engine_kwargs())
    try:
        outs = _generate(dp, "json")
        _assert_obeys("json", outs)
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in reference]
        with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
            dp.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
        assert not dp.llm_engine.has_unfinished_requests()
    finally:
        dp.llm_engine.close()


def test_bad_constraints_are_named(llm):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs.json=.* is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice=.*non-empty strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown field.*regexp"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.grammar does not compile"):
        llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "start: nothing_defined"}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued by the refused requests


def test_speculative_decoding():
    """A grammar's request does not speculate (each position's mask would follow the proposals before it): it
    decodes a token per verify step beside requests that do, and every output is the plain engine's. A draft
    model with its fed rounds: the proposer the host sees least of (n-gram proposals pass the same scheduler and
    verify code)."""
    from engine_fixtures import generate, speculative_engine

    spec = speculative_engine({"method": "draft_model", "model": checkpoint("llama_gqa"), "num_speculative_tokens": 2})
    repetitive = "a b c a b c a b c a b c"  # ngram proposals for the unconstrained requests
    prompts = [repetitive, PROMPTS[0], repetitive, PROMPTS[1]]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=CONSTRAINTS[kind][0])
                   for kind in ("json", "regex")]
    params = [plain, constrained[0], plain, constrained[1]]
    outs = generate(spec, prompts, params)
    want = generate(spec, prompts, params, speculate=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    _assert_obeys("json", [outs[1]])
    _assert_obeys("regex", [outs[3]])
    assert spec.llm_engine.speculator.stats.num_drafts > 0


def test_refused_without_a_tokenizer():
    compiler = GrammarCompiler(None, vocab_size=512, eos_token_ids=(2,))  # an engine with skip_tokenizer_init=True
    with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
        compiler.compile(StructuredOutputsParams(choice=CHOICES))

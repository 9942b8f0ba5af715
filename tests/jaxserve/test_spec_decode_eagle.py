"""EAGLE speculation (method "eagle" / "eagle3") on tiny random heads for the tiny Llama target.

Exactness is by construction (the target verifies every proposal), so greedy output must equal the plain
engine's token for token, across chunked prefill, prefix caching, preemption, a stop string and max_tokens
cut-offs inside a step. That alone would hide a wrongly computed head (its proposals would just be rejected),
so the head's proposals are also compared with a numpy re-implementation over the target's hidden states
(transformers' ``output_hidden_states``), at tensor_parallel_size=1 and 2 (the fake CPU devices of conftest).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from engine_fixtures import (
    _ROOT, check_priming_writes_no_kv, checkpoint, completions, fresh_compiles, generate, speculative_engine,
)
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file
from tiny_models import hf_greedy

from jaxserve import SamplingParams, sharding

K = 3
D, H, KV, DH, F, V, VD = 64, 4, 2, 16, 128, 512, 300  # the llama_gqa target's widths; VD: EAGLE-3's draft vocab


def _w(rng, *shape):
    return (rng.standard_normal(shape) * 0.1).astype(np.float32)


def _layer(rng, prefix: str, attn_in: int) -> dict:
    t = {
        f"{prefix}.self_attn.q_proj.weight": _w(rng, H * DH, attn_in),
        f"{prefix}.self_attn.k_proj.weight": _w(rng, KV * DH, attn_in),
        f"{prefix}.self_attn.v_proj.weight": _w(rng, KV * DH, attn_in),
        f"{prefix}.self_attn.o_proj.weight": _w(rng, D, H * DH),
        f"{prefix}.mlp.gate_proj.weight": _w(rng, F, D),
        f"{prefix}.mlp.up_proj.weight": _w(rng, F, D),
        f"{prefix}.mlp.down_proj.weight": _w(rng, D, F),
        f"{prefix}.post_attention_layernorm.weight": 1 + _w(rng, D),
    }
    return t


def make_head(version: int) -> str:
    """A random EAGLE head in the published layout (EAGLE-1: yuhuili/EAGLE-LLaMA3-Instruct-8B's names, with an
    fc bias and the embedding copy some checkpoints carry; EAGLE-3: EAGLE3-LLaMA3.1-Instruct-8B's)."""
    path = os.path.join(_ROOT, f"eagle{version}_head")
    if os.path.exists(path):
        return path
    os.makedirs(path)
    rng = np.random.default_rng(version)
    config = dict(
        architectures=["LlamaForCausalLMEagle" if version == 1 else "LlamaForCausalLMEagle3"], model_type="llama",
        hidden_size=D, intermediate_size=F, num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=KV,
        head_dim=DH, vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    )  # fmt: skip
    if version == 1:
        t = {"fc.weight": _w(rng, D, 2 * D), "fc.bias": _w(rng, D), "embed_tokens.weight": _w(rng, V, D),
             **_layer(rng, "layers.0", D)}
    else:
        config.update(draft_vocab_size=VD, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
        targets = np.sort(rng.choice(V, VD, replace=False))
        t2d = np.zeros(V, bool)
        t2d[targets] = True
        t = {"fc.weight": _w(rng, D, 3 * D), **_layer(rng, "midlayer", 2 * D),
             "midlayer.input_layernorm.weight": 1 + _w(rng, D), "midlayer.hidden_norm.weight": 1 + _w(rng, D),
             "norm.weight": 1 + _w(rng, D), "lm_head.weight": _w(rng, VD, D),
             "d2t": (targets - np.arange(VD)).astype(np.int64), "t2d": t2d}
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


def _engine(version: int, **kw):
    spec = {"method": "eagle" if version == 1 else "eagle3", "model": make_head(version), "num_speculative_tokens": K}
    return speculative_engine(spec, **kw)


@pytest.fixture(scope="module")
def llm():
    # EAGLE-3 (the engine-side logic is the same for both versions; the heads differ, and
    # test_head_proposals_match_a_reference checks both). 28 blocks of 4: preemption under load.
    return _engine(3, num_gpu_blocks_override=28)


def test_greedy_exact(llm):
    shared = _ids(10, 7)
    prompts = [{"prompt_token_ids": shared + _ids(3 + i, 20 + i)} for i in range(4)]
    prompts.append({"prompt_token_ids": _ids(40, 40)})  # 40 > the 32-token budget: chunked prefill
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (28, 7, 21, 14, 17)]
    plain = completions(generate(llm, prompts, params, speculate=False))
    engine = llm.llm_engine
    preempted, hits = engine.scheduler.num_preemptions, engine.scheduler.prefix_cache_hits
    stats = engine.speculator.stats
    drafts = stats.num_drafts
    assert completions(generate(llm, prompts, params)) == plain
    assert engine.scheduler.num_preemptions > preempted and engine.scheduler.prefix_cache_hits > hits
    assert stats.num_drafts > drafts and engine.speculator.num_fed_rounds > 0
    assert engine.speculator.num_device_fed_steps > 0  # verify steps that read the proposals on the device
    # A stop string inside the text (wherever a step's accepted tokens reach it), alone in the engine.
    text = plain[0][0][1]
    stop = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, stop=[text[12:15]])
    one = [prompts[0]]
    ref = completions(generate(llm, one, [stop], speculate=False))
    assert ref[0][0][2] == "stop" and completions(generate(llm, one, [stop])) == ref


def test_sampled_rows_complete_and_follow_the_seed(llm):
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=15, ignore_eos=True) for s in (1, 2)]
    prompts = [{"prompt_token_ids": _ids(9, 50 + i)} for i in range(2)]
    first = completions(generate(llm, prompts, sp))
    assert [len(o[0][0]) for o in first] == [15, 15]
    assert completions(generate(llm, prompts, sp)) == first


def test_head_cache_consistent_after_rejections(llm):
    """Sampled rows reject often; after every step, the proposals (mostly from rounds fed on the device by the
    verify step) must equal those the head makes from an empty cache (every pair recomputed)."""
    engine = llm.llm_engine
    spec = engine.speculator
    sp = SamplingParams(temperature=1.5, seed=1, max_tokens=20, ignore_eos=True)
    for i, n in enumerate((6, 11)):
        engine.add_request(f"c{i}", {"prompt_token_ids": _ids(n, 30 + i)}, sp)
    compared, fed = 0, spec.num_fed_rounds
    while engine.has_unfinished_requests():
        engine.step()
        engine.speculator.materialize()  # proposals a fed round left on the device, as values
        running = [r for r in engine.scheduler.running if r.spec_token_ids]
        incremental = {r.request_id: list(r.spec_token_ids) for r in running}
        spec.draft._states.clear()  # forget what the head's cache holds: recompute from position 0
        spec.draft.propose(running, K, engine.scheduler.kv)
        assert {r.request_id: r.spec_token_ids for r in running} == incremental
        compared += len(running)
    assert compared > 5 and spec.num_fed_rounds > fed
    assert spec.stats.num_draft_tokens > spec.stats.num_accepted_tokens


def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rope(x, pos, theta=10000.0):  # x [n, h, dh]
    inv = 1.0 / theta ** (np.arange(0, DH, 2) / DH)
    ang = pos[:, None] * inv[None, :]  # [n, dh/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    half = np.concatenate([-x[..., DH // 2 :], x[..., : DH // 2]], -1)
    return x * cos + half * sin


def _attention(t, p, x):  # causal GQA self-attention over the whole sequence x [n, in]
    n = x.shape[0]
    q = _rope((x @ t[f"{p}.q_proj.weight"].T).reshape(n, H, DH), np.arange(n))
    k = _rope((x @ t[f"{p}.k_proj.weight"].T).reshape(n, KV, DH), np.arange(n))
    v = (x @ t[f"{p}.v_proj.weight"].T).reshape(n, KV, DH)
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(DH) + np.triu(np.full((n, n), -1e30), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", a, v).reshape(n, H * DH) @ t[f"{p}.o_proj.weight"].T


def _head(t, version, emb, hidden):  # (embeddings of tokens i + 1, hidden states of positions i) -> outputs
    p = "layers.0" if version == 1 else "midlayer"
    if version == 1:
        x = np.concatenate([emb, hidden], -1) @ t["fc.weight"].T + t["fc.bias"]
        x = x + _attention(t, f"{p}.self_attn", x)
    else:
        both = np.concatenate(
            [_rms(emb, t[f"{p}.input_layernorm.weight"]), _rms(hidden, t[f"{p}.hidden_norm.weight"])], -1
        )
        x = hidden + _attention(t, f"{p}.self_attn", both)
    h = _rms(x, t[f"{p}.post_attention_layernorm.weight"])
    gate, up = h @ t[f"{p}.mlp.gate_proj.weight"].T, h @ t[f"{p}.mlp.up_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * up) @ t[f"{p}.mlp.down_proj.weight"].T


def _first_proposals_match_a_reference(engine, version: int, max_tokens: int = 8):
    """A 12-token greedy prompt's first step (the prompt, then the head proposes): the head's k proposals equal
    those of a numpy re-implementation over the target's hidden states (transformers' ``output_hidden_states``).
    Returns the request, still running."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    engine.add_request("r", {"prompt_token_ids": _ids(12, 3)}, SamplingParams(temperature=0, max_tokens=max_tokens))
    engine.step()
    r = engine.scheduler.running[0]
    tokens, proposals = list(r.all_token_ids), list(r.spec_token_ids)
    assert len(tokens) == 13 and len(proposals) == K

    hf = AutoModelForCausalLM.from_pretrained(checkpoint("llama_gqa"), torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)  # what the target computed
    states = [s[0].numpy() for s in out.hidden_states]  # L + 1 of [12, D]
    embed = hf.model.embed_tokens.weight.detach().numpy()
    lm_head = hf.lm_head.weight.detach().numpy()
    t = load_file(os.path.join(make_head(version), "model.safetensors"))
    hidden = states[-1] if version == 1 else np.concatenate(states[:3], -1) @ t["fc.weight"].T
    seq = list(tokens)
    for _ in range(K):  # pairs (token i + 1, hidden i); drafted positions take the head's own output
        x = _head(t, version, embed[seq[1:]], hidden)
        if version == 1:
            nxt = int(np.argmax(x[-1] @ lm_head.T))
        else:
            d = int(np.argmax(_rms(x[-1], t["norm.weight"]) @ t["lm_head.weight"].T))
            nxt = d + int(t["d2t"][d])
        seq.append(nxt)
        hidden = np.concatenate([hidden, x[-1:]], 0)
    assert proposals == seq[len(tokens) :]
    return r


@pytest.mark.parametrize("version", [1, 3])
def test_head_proposals_match_a_reference(version, request):
    engine = (_engine(1) if version == 1 else request.getfixturevalue("llm")).llm_engine
    _first_proposals_match_a_reference(engine, version)
    if version == 1:
        # A single stream, to its end (max_tokens cuts the last proposals), uses only programs that
        # precompile="common" compiles at start-up (this engine compiled them on first use instead: cheaper here).
        while engine.has_unfinished_requests():
            engine.step()
        spec = engine.speculator
        spec.verifier.runner.runner_config = dataclasses.replace(engine.runner.runner_config, precompile="common")
        assert spec.stats.num_drafts > 2 and set(spec.verifier._programs) <= set(spec.verifier.startup_shapes())
        assert set(spec.draft.programs._programs) <= set(spec.draft.programs.shapes())


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
@pytest.mark.parametrize("version", [1, 3])
def test_tensor_parallel(version, request):
    """tensor_parallel_size=2: the head sharded as the target's layers, the hidden-state store split by width
    (jaxserve.sharding). Its proposals still match the reference, a greedy request (rounds fed by the verify step
    included) gives transformers' greedy tokens (as the plain engine does at TP=1 and 2: test_tp_dp), and seeded
    sampled requests give the TP=1 EAGLE-3 engine's tokens (the same proposals, hence the same rejection-sampling
    draws). Few requests: every new shape compiles on first use here, for TP=2."""
    llm = _engine(version, tensor_parallel_size=2)
    engine = llm.llm_engine
    r = _first_proposals_match_a_reference(engine, version, max_tokens=16)
    while engine.has_unfinished_requests():
        engine.step()
    assert r.output_token_ids == hf_greedy(checkpoint("llama_gqa"), r.prompt_token_ids, 16)
    assert engine.speculator.stats.num_drafts > 2 and engine.speculator.num_fed_rounds > 0
    assert engine.speculator.num_device_fed_steps > 0  # the hidden states handed over in the split layout
    runner, draft = engine.runner, engine.speculator.draft
    assert runner.kv_caches[-1].sharding.spec == P(None, "model")  # the store [num_slots, W]
    for pages in draft.programs.kv_caches[0]:  # the head's KV cache: by KV heads, as the target's
        # the head's cache has the target's layout: heads-major [N, K, P, D] on the CPU's xla backend
        assert runner.kv_heads_major
        assert pages.sharding.spec == sharding.logical_spec(sharding.KV_CACHE_HEADS_MAJOR_AXES) == P(None, "model", None, None)
    if version == 3:
        tp1 = request.getfixturevalue("llm")
        sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2)]
        sampled = [{"prompt_token_ids": _ids(9, 50 + i)} for i in range(2)]
        assert completions(generate(llm, sampled, sp)) == completions(generate(tp1, sampled, sp))


def test_round_programs_are_stored_and_loaded(llm, tmp_path, monkeypatch):
    """A second start loads the head's round programs (its own and the fed ones) that an earlier start compiled
    (the target runner's executable store, in a context that adds the head; on accelerators it persists between
    starts, opened here on CPU too), and greedy output is the plain engine's; another head is not served them."""
    from flax import nnx

    from jaxserve import executable_store
    from jaxserve.spec_decode.draft_program import RoundPrograms
    from jaxserve.spec_decode.eagle import EaglePrograms
    from jaxserve.spec_decode.fed_rounds import FedPrograms

    monkeypatch.setattr(executable_store.ExecutableStore, "open",
                        classmethod(lambda cls, cache_dir, platform, context: cls(str(tmp_path), context)))
    # One start-up shape (the single stream's: 4 tokens, the shortest width), so that the test compiles little.
    monkeypatch.setattr(RoundPrograms, "shapes", lambda self: [(4, self.runner.width_buckets[0])])
    proposer = llm.llm_engine.speculator.draft
    saved = proposer.programs, proposer.fed
    head = nnx.merge(saved[0].head_graph, jax.tree.unflatten(saved[0].head_tree, saved[0].head_params))

    def start():
        programs = EaglePrograms(saved[0].runner, head, np.asarray(saved[0].d2t), saved[0].kv_caches, K)
        fed = FedPrograms(programs, K)
        programs.warmup()
        fed.warmup()
        return programs, fed

    with fresh_compiles():  # the cold start compiles what it stores, as on a fresh machine
        cold, warm = start(), start()
    assert [p.num_loaded_programs for p in cold] == [0, 0] and [p.num_loaded_programs for p in warm] == [1, 1]
    assert len(list(tmp_path.glob("eagle-k3-*.jxe"))) == len(list(tmp_path.glob("eagle-fed-k3-*.jxe"))) == 1
    prompts = [{"prompt_token_ids": _ids(3, 3)}]  # every round of 1..4 pairs: the stored programs
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    plain = completions(generate(llm, prompts, params, speculate=False))
    proposer.programs, proposer.fed = warm
    fed_rounds = llm.llm_engine.speculator.num_fed_rounds
    try:
        assert completions(generate(llm, prompts, params)) == plain
    finally:
        proposer.programs, proposer.fed = saved
        saved[0].kv_caches = warm[0].kv_caches  # the head's cache, donated through the warm programs' calls
    assert llm.llm_engine.speculator.num_fed_rounds > fed_rounds
    assert warm[0].num_lazy_compiles == warm[1].num_lazy_compiles == 0  # only the loaded programs ran
    # Another head (here: an EAGLE-1 head of the same config) is another program, on the same target and shapes.
    name = warm[0]._store_name(warm[0].shapes()[0])
    assert warm[0]._store().load(name, jax.devices()[:1]) is not None
    warm[0].head_config = (warm[0].head_config[0], 1)
    assert warm[0]._store().load(name, jax.devices()[:1]) is None


def test_priming_writes_no_kv(llm, monkeypatch):
    prompts = [{"prompt_token_ids": _ids(9, 60 + i)} for i in range(2)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    check_priming_writes_no_kv(llm, monkeypatch, prompts, params)

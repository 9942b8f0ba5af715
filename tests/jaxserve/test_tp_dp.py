"""Tensor and data parallelism on 8 fake CPU devices: greedy output equals TP=1 and HF transformers token
for token, every weight and the KV cache are sharded as jaxserve.sharding's rules say, and the DP
router spreads requests over replicas on disjoint devices."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from dp_probes import fail_steps, hard_exit, replica_view
from engine_fixtures import _ROOT, checkpoint, small_engine_kwargs
from flax import nnx
from jax.sharding import PartitionSpec as P
from tiny_models import hf_greedy, make_tiny_checkpoint

from jaxserve import LLM, SamplingParams, sharding
from jaxserve.dp_engine import DPEngine
from jaxserve.replica_client import EngineCoreError

MAX_TOKENS = 8
PROMPT_LENS = (3, 17, 40)  # 40 > the 32-token step budget: chunked prefill runs under TP too

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@functools.lru_cache(maxsize=None)
def _model(name: str) -> str:
    if name == "heads8":  # 8 query and 8 KV heads, so TP=8 splits one head per device
        path = os.path.join(_ROOT, "heads8")
        make_tiny_checkpoint(path, "llama", num_attention_heads=8, num_key_value_heads=8, head_dim=8)
        return path
    return checkpoint(name)


@functools.lru_cache(maxsize=None)
def _llm(name: str, tp: int, dp: int = 1) -> LLM:
    return LLM(_model(name), tensor_parallel_size=tp, data_parallel_size=dp, **small_engine_kwargs(max_model_len=64))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(2, 500, size=n).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def _greedy(name: str, tp: int, dp: int = 1) -> tuple:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = _llm(name, tp, dp).generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


@pytest.mark.parametrize(
    "name,tp,dp",
    [("llama_gqa", 2, 1), ("llama_gqa", 2, 2), ("llama_mha_tied", 4, 1), ("heads8", 8, 1)],
    ids=["tp2", "dp2xtp2", "tp4-tied", "tp8"],
)
def test_greedy_equals_tp1_and_hf(name, tp, dp):
    got = _greedy(name, tp, dp)
    assert got == _greedy(name, 1), f"tp={tp} dp={dp} differs from tp=1"
    path = _model(name)
    assert list(got) == [tuple(hf_greedy(path, p, MAX_TOKENS)) for p in _prompts()]


def _check_placed(arr: jax.Array, names, mesh) -> None:
    want = sharding.logical_spec(names, arr.shape, mesh)
    assert arr.sharding.mesh.devices.tolist() == mesh.devices.tolist(), names
    assert arr.sharding.spec == want, (names, arr.sharding.spec, want)


def test_weights_and_kv_cache_follow_the_rules_table():
    llm = _llm("llama_gqa", 2)
    _greedy("llama_gqa", 2)  # after steps: the donated cache must come back with the same sharding
    runner = llm.llm_engine.runner
    mesh = runner.mesh
    assert dict(mesh.shape) == {"data": 1, "model": 2}
    for path, var in nnx.to_flat_state(runner.state):
        _check_placed(var.get_value(), var.get_metadata()["out_sharding"], mesh)
    layer0 = runner.state["model"]["layers"][0]
    # The table, spelled out once here so a change to it is a visible decision.
    assert layer0["self_attn"]["qkv_proj"]["kernel"][...].sharding.spec == P(None, "model", None, None)
    assert layer0["mlp"]["gate_up_proj"]["kernel"][...].sharding.spec == P(None, None, "model")
    assert layer0["self_attn"]["o_proj"]["kernel"][...].sharding.spec == P("model", None)
    assert layer0["mlp"]["down_proj"]["kernel"][...].sharding.spec == P("model", None)
    assert runner.state["model"]["embed_tokens"]["embedding"][...].sharding.spec == P("model", None)
    assert layer0["input_layernorm"]["scale"][...].sharding.spec == P(None)
    assert runner.kv_heads_major  # the CPU's xla backend: pages [N, K, P, D], split on the heads axis
    for k_pages, v_pages in runner.kv_caches:
        for pages in (k_pages, v_pages):
            _check_placed(pages, sharding.KV_CACHE_HEADS_MAJOR_AXES, mesh)
            assert pages.sharding.spec == P(None, "model", None, None)
            n, k, p, d = pages.shape
            assert {s.data.shape for s in pages.addressable_shards} == {(n, k // 2, p, d)}


def test_dp_replicas_on_disjoint_devices_and_router_balances():
    llm = _llm("llama_gqa", 2, 2)
    engine = llm.llm_engine
    assert isinstance(engine, DPEngine) and len(engine.replicas) == 2
    assert engine.info()["replica_devices"] == [[0, 1], [2, 3]]
    # Each replica's process sees only its own 2 devices, and shards its KV cache over them.
    for view in engine.collective_rpc(replica_view):
        assert view["num_devices"] == 2 and view["mesh_shape"] == {"data": 1, "model": 2}
        assert view["kv_spec"] == tuple(P(None, "model", None, None))  # heads-major pages [N, K, P, D]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i, p in enumerate(_prompts() * 2):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    assert [engine.replica_load(i)[0] for i in range(2)] == [3, 3]
    stats = engine.get_stats()  # sent, not yet seen by the replicas: counted as waiting
    assert stats.num_running + stats.num_waiting == 6
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("b0", {"prompt_token_ids": [5, 6]}, params)
    engine.abort_request(["b0", "b1"])
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"b{i}" for i in range(2, 6)}
    assert engine.replica_load(0) == engine.replica_load(1) == (0, 0)
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert engine.info()["data_parallel_size"] == 2

    # A text prompt is tokenized once (by the router), and its text still comes back with the output.
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(a) or encode(*a, **k)
    try:
        out = llm.generate("hello world", params, use_tqdm=False)[0]
    finally:
        engine.tokenizer.encode = encode
    assert len(calls) == 1 and out.prompt == "hello world" and out.prompt_token_ids == encode("hello world")


def test_dp_batch_equals_one_engine_and_abort_mid_flight():
    """A batch spread over 2 replica processes gives one engine's greedy tokens; a request aborted while
    its replica runs it ends with finish_reason "abort" and the tokens it had, and the others finish."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, size=n).tolist() for n in (5, 9, 30, 2, 17, 44, 8, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    got = _llm("llama_gqa", 2, 2).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = _llm("llama_gqa", 2).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == prompts

    engine = _llm("llama_gqa", 2, 2).llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"m{i}", {"prompt_token_ids": p}, long)
    assert engine.replica_load(1)[0] == 2  # m1 runs on replica 1
    seen: dict[str, int] = {}
    finished = {}  # from the start: on a loaded machine replica 0 may finish its requests before m1 has 2 tokens
    while seen.get("m1", 0) < 2:  # until m1 has 2 tokens
        outs = engine.step()
        seen.update({o.request_id: len(o.outputs[0].token_ids) for o in outs})
        finished.update({o.request_id: o for o in outs if o.finished})
    (aborted,) = engine.abort_request("m1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.prompt_token_ids == prompts[1] and 2 <= len(aborted.outputs[0].token_ids) < 40
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["m0", "m2", "m3"]
    assert all(o.outputs[0].finish_reason == "length" for o in finished.values())
    assert engine.replica_load(0) == engine.replica_load(1) == (0, 0)


def test_dp_replica_failure_is_a_clear_error():
    """A replica whose step raises fails the caller with its traceback (again on later calls, no hang);
    a replica that dies without a word is reported with its exit code; close() ends the processes."""
    # enforce_eager: nothing to compile, as the steps fail before they run the model
    llm = LLM(_model("llama_gqa"), data_parallel_size=2, enforce_eager=True, **small_engine_kwargs(max_model_len=32))
    engine = llm.llm_engine
    engine.collective_rpc(fail_steps, "boom in the step")
    with pytest.raises(EngineCoreError, match=r"(?s)replica 0 .*failed:.*Traceback.*boom in the step"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(EngineCoreError, match="boom in the step"):
        engine.step()
    engine.replicas[1].send(("rpc", -1, hard_exit, (3,)))
    assert engine.replicas[1].proc.wait(60) == 3
    with pytest.raises(EngineCoreError, match=r"replica 1 \(pid \d+\) exited with code 3"):
        engine.replicas[1].receive_all()
    engine.close()
    assert [r.proc.poll() for r in engine.replicas] == [1, 3]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 does not divide the model's 4 attention heads"),
        (dict(tensor_parallel_size=4), r"tensor_parallel_size=4 does not divide the model's 2 key/value heads"),
        (dict(tensor_parallel_size=4, data_parallel_size=4), r"needs 16 devices, but only 8"),
        (dict(data_parallel_size=0), r"data_parallel_size=0 is invalid"),
        # found by the replicas' processes while they build their engines: raised here as by one engine
        (dict(data_parallel_size=2, max_model_len=4096),
         r"max_model_len=4096 exceeds the model's max_position_embeddings"),
    ],
)
def test_invalid_parallel_sizes_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(_model("llama_gqa"), **small_engine_kwargs(**kwargs))

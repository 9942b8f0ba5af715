"""Multi-LoRA serving: greedy tokens equal HF + PEFT per adapter, mixed batches equal each request alone,
the prefix cache never shares blocks across adapters, and the scheduler keeps to max_loras."""

from __future__ import annotations

import json
import os
import tempfile
import threading

import jax
import numpy as np
import pytest
from engine_fixtures import checkpoint, small_engine_kwargs
from lora_fixtures import make_peft_adapter, peft_greedy
from tiny_models import hf_greedy

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.lora.peft_loader import read_adapter_config

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters():
    base = checkpoint("llama_gqa")
    root = tempfile.mkdtemp(prefix="jaxserve-lora-")
    paths = {
        # rank 8 on attention only; rank 16 everywhere; rank 16 rsLoRA on the MLP only
        "a8": make_peft_adapter(base, os.path.join(root, "a8"), r=8, targets=["q_proj", "v_proj", "o_proj"], seed=1),
        "b16": make_peft_adapter(base, os.path.join(root, "b16"), r=16, seed=2),
        "c16": make_peft_adapter(base, os.path.join(root, "c16"), r=16, seed=3, use_rslora=True,
                                 targets=["gate_proj", "up_proj", "down_proj", "k_proj"]),  # fmt: skip
    }
    return base, {name: LoRARequest(name, i + 1, p) for i, (name, p) in enumerate(paths.items())}


@pytest.fixture(scope="module")
def llm(adapters):
    base, _ = adapters
    # max_loras=2 with three adapters: steps mix two adapters and the base; the third waits, then evicts one.
    return LLM(base, **small_engine_kwargs(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, precompile="none"))


def _prompt(n=11, seed=0):
    return np.random.default_rng(seed).integers(2, 500, size=n).tolist()


SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _gen(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_matches_peft_and_mixed_batch_matches_alone(llm, adapters):
    base, loras = adapters
    prompt = _prompt()
    alone = {}
    for name, lora in loras.items():
        alone[name] = _gen(llm, [prompt], lora)[0]
        assert alone[name] == peft_greedy(base, lora.lora_path, prompt, MAX_TOKENS), name
    # The base model after the adapters ran on the same prompt: its blocks are cached under the adapters' keys
    # only, so a hit here would read an adapter's KV.
    alone[None] = _gen(llm, [prompt], None)[0]
    assert alone[None] == hf_greedy(base, prompt, MAX_TOKENS, ignore_eos=True)
    assert len({tuple(v) for v in alone.values()}) == 4  # every adapter changes the output

    # One batch: the same prompt under every adapter and none, plus other prompts; three adapters > max_loras.
    other = _prompt(17, seed=5)
    order = ["a8", None, "b16", "c16", "a8", None]
    prompts = [prompt] * 4 + [other, other]
    mixed = _gen(llm, prompts, [loras[n] if n else None for n in order])
    assert mixed[:4] == [alone[n] for n in order[:4]]
    assert mixed[4] == _gen(llm, [other], loras["a8"])[0]
    assert mixed[5] == _gen(llm, [other], None)[0]
    slots = llm.llm_engine.runner.lora
    assert len(slots.resident) <= 2 and len(slots.host) <= 2
    # Slots were rewritten as adapters came and went, by one program: the slot arrays are step arguments.
    assert slots.num_slot_writes > 3 and slots._write._cache_size() == 1
    assert slots.folded  # one device: each group's A sits beside its base kernel (models/lora.py's fold)
    # ... and the base kernels live only there: the runner's parameters hold no array of a base kernel's shape.
    # (Not jax.live_arrays(): in a whole-suite run other tests' engines of the same tiny model are still alive.)
    runner = llm.llm_engine.runner
    cfg = runner.text_config
    k, g = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    kernel_shapes = {(cfg.hidden_size, k, g + 2, cfg.head_dim), (cfg.hidden_size, 2, cfg.intermediate_size)}
    assert not [a.shape for a in runner.step_params() if a.shape in kernel_shapes]
    assert not [a.shape for a in jax.tree.leaves(runner.state) if getattr(a, "shape", None) in kernel_shapes]


def test_reading_an_adapter_does_not_stall_other_requests(llm, adapters, monkeypatch):
    """The adapter's tensors are read in the background; base requests finish meanwhile, then it runs exactly."""
    base, loras = adapters
    engine = llm.llm_engine
    slots = engine.runner.lora
    gate = threading.Event()
    read = slots._read
    monkeypatch.setattr(slots, "_read", lambda request: (gate.wait(60), read(request))[1])
    slow = LoRARequest("a8-again", 99, loras["a8"].lora_path)  # a new id: not on the host yet
    prompt, other = _prompt(), _prompt(9, seed=7)
    engine.add_request("slow", {"prompt_token_ids": prompt}, SP, lora_request=slow)
    engine.add_request("fast", {"prompt_token_ids": other}, SP)
    done = {}
    for _ in range(200):
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        if "fast" in done:
            break
    assert "fast" in done and engine.scheduler.get_request("slow").num_computed_tokens == 0
    gate.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done["slow"] == peft_greedy(base, loras["a8"].lora_path, prompt, MAX_TOKENS)
    assert engine.remove_lora(99)


def test_lora_needs_enable_lora():
    from types import SimpleNamespace

    from jaxserve.llm_engine import LLMEngine

    engine = LLMEngine.__new__(LLMEngine)  # no model needed: the check comes before any weight is read
    engine.runner = SimpleNamespace(lora=None)
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_lora(LoRARequest("x", 1, "/nope"))


def _write_config(tmp_path, **overrides):
    cfg = dict(peft_type="LORA", r=8, lora_alpha=16, target_modules=["q_proj"], bias="none")
    cfg.update(overrides)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(target_modules=["q_proj", "lm_head"]), "target_modules"),
        (dict(target_modules=["embed_tokens"]), "target_modules"),
        (dict(r=32), "max_lora_rank"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ],
)
def test_unsupported_adapters_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        read_adapter_config(_write_config(tmp_path, **overrides), max_lora_rank=16)


def test_scheduler_keeps_to_max_loras():
    from jaxserve.request import Request
    from jaxserve.scheduler import Scheduler

    sched = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32, block_size=4, num_blocks=64, max_loras=2)
    loras = [LoRARequest(f"l{i}", i, "") for i in (1, 2, 3)]
    for i, lora in enumerate([loras[0], None, loras[1], loras[2], loras[0], None]):
        sched.add_request(Request(str(i), [5, 6, 7], SamplingParams(max_tokens=4), lora_request=lora))
    out = sched.schedule()
    assert [s.req_id for s in out.seqs] == ["0", "1", "2", "4", "5"]  # "3" (a third adapter) waits
    assert {s.lora_request.lora_int_id for s in out.seqs if s.lora_request} == {1, 2}


def test_tensor_and_data_parallel_match_peft(adapters):
    """TP=2 (A sharded like the input, B like the output) inside each of DP=2 replica processes, which get the
    LoRARequest with each request."""
    base, loras = adapters
    llm = LLM(base, tensor_parallel_size=2, data_parallel_size=2,
              **small_engine_kwargs(enable_lora=True, max_loras=2, precompile="none"))  # fmt: skip
    prompt = _prompt()
    names = ["b16", None, "a8", "b16"]
    got = _gen(llm, [prompt] * 4, [loras[n] if n else None for n in names])
    want = {n: peft_greedy(base, loras[n].lora_path, prompt, MAX_TOKENS) for n in ("a8", "b16")}
    want[None] = hf_greedy(base, prompt, MAX_TOKENS, ignore_eos=True)
    assert got == [want[n] for n in names]
    llm.llm_engine.close()

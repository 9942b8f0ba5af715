"""Beyond one machine: two JAX processes (jax.distributed, a local coordinator) form one TP=4 mesh of
2 + 2 CPU devices, and the engine's greedy output equals HF transformers.

Multi-controller JAX runs the same program in every process: each process builds the same engine
and is given the same requests, so the deterministic scheduler issues the same steps everywhere, and
XLA's collectives (gloo on CPU) carry the tensor-parallel all-reduces between the processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

MAX_TOKENS = 6
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12, 8]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(process_id: int, port: int, model: str, out_path: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()

    from jaxserve import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=4, dtype="float32", max_model_len=64, max_num_batched_tokens=16,
              max_num_seqs=4, block_size=4, compilation_cache_dir="", use_tqdm_on_load=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    jax.distributed.shutdown()


def test_two_process_tensor_parallel_matches_hf(tmp_path):
    from engine_fixtures import checkpoint
    from tiny_models import hf_greedy

    model = checkpoint("llama_mha_tied")  # 4 heads, 4 KV heads: TP=4 over the two processes
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port), model, str(tmp_path / f"out{i}.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two-process run timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    got = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert got[0] == got[1]
    assert got[0] == [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

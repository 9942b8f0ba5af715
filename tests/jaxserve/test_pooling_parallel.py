"""Embedding models under tensor and data parallelism (8 fake CPU devices): TP=2 and DP=2 embeddings equal
TP=1's (cosine >= 0.99999) for all-MiniLM-L6-v2 (BERT) and a tiny decoder embedder; weights are sharded by
jaxserve.sharding's rules; DP spreads one call's batches over both replicas; the server answers under TP."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from embedding_fixtures import minilm_path, sentences
from engine_fixtures import _ROOT, run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve.llm import LLM

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest fakes 8 CPU devices)")

TOKEN_PROMPTS = [[0, 5, 9, 200, 31], [0, 7], list(range(2, 60)), list(range(3, 30)), [0, 1, 2, 3, 4, 5, 6, 7, 8]]


def _decoder_path() -> str:
    path = os.path.join(_ROOT, "llama_embedder")
    if not os.path.exists(path):
        make_tiny_checkpoint(path, "llama")
    return path


@functools.lru_cache(maxsize=None)
def _llm(kind: str, tp: int, dp: int) -> LLM:
    if kind == "minilm":  # small steps: 2 rows of 128 tokens, so one call makes several batches
        kw = dict(max_model_len=128, max_num_batched_tokens=256)
        return LLM(minilm_path(), tensor_parallel_size=tp, data_parallel_size=dp, precompile="none",
                   compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False, **kw)  # fmt: skip
    return LLM(_decoder_path(), runner="pooling", dtype="float32", max_model_len=64, max_num_batched_tokens=64,
               tensor_parallel_size=tp, data_parallel_size=dp, precompile="none", compilation_cache_dir=run_cache_dir(),
               use_tqdm_on_load=False)  # fmt: skip


def _embed(kind: str, tp: int, dp: int) -> np.ndarray:
    prompts = sentences(24) if kind == "minilm" else [{"prompt_token_ids": p} for p in TOKEN_PROMPTS]
    return np.array([o.outputs.embedding for o in _llm(kind, tp, dp).embed(prompts, use_tqdm=False)])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("kind", ["minilm", "decoder"])
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "dp2"])
def test_parallel_embeddings_equal_tp1(kind, tp, dp):
    base, got = _embed(kind, 1, 1), _embed(kind, tp, dp)
    assert got.shape == base.shape
    cos = _cosines(got, base)
    assert cos.min() >= 0.99999, (cos.min(), int(cos.argmin()))
    engine = _llm(kind, tp, dp).llm_engine
    info = engine.info()
    assert (info["tensor_parallel_size"], info["data_parallel_size"]) == (tp, dp)
    if dp > 1:  # replicas on disjoint devices, and both used by one call
        devices = [set(r.mesh.devices.flat) for r in engine.runners]
        assert not devices[0] & devices[1]
        assert all(r.num_steps > 0 for r in engine.runners), [r.num_steps for r in engine.runners]


def test_tp_weights_follow_the_rules_table():
    runner = _llm("minilm", 2, 1).llm_engine.runner
    mesh = runner.mesh
    assert dict(mesh.shape) == {"data": 1, "model": 2}
    split = 0
    for x in runner._leaves:
        assert x.sharding.mesh.devices.tolist() == mesh.devices.tolist()
        split += any(axis == "model" for axis in x.sharding.spec)
    assert split >= 6 * 4  # per layer at least query, key, value, attention output and the two MLP matrices


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_tp_refuses_heads_it_cannot_split():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not divide the model's 12 attention heads"):
        LLM(minilm_path(), tensor_parallel_size=8, compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False)


def test_server_embeddings_under_tp():
    """`jaxserve serve MINILM --tensor-parallel-size 2` (its flags, parsed as the CLI does) answers /v1/embeddings
    with TP=1's vectors."""
    import requests

    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.cli import build_parser, engine_args_from, parse_args
    from jaxserve.server.testing import ServerThread

    ns = parse_args(build_parser(), ["serve", minilm_path(), "--tensor-parallel-size", "2", "--max-model-len", "128",
                                     "--max-num-batched-tokens", "256", "--precompile", "none",
                                     "--compilation-cache-dir", run_cache_dir()])  # fmt: skip
    args = engine_args_from(ns)
    assert args.tensor_parallel_size == 2
    texts = sentences(24)[:3]
    want = np.array([o.outputs.embedding for o in _llm("minilm", 1, 1).embed(texts, use_tqdm=False)])
    with ServerThread(AsyncLLMEngine.from_engine_args(args, progress=False)) as srv:
        resp = requests.post(srv.url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=60)
    assert resp.status_code == 200, resp.text
    got = np.array([d["embedding"] for d in resp.json()["data"]])
    assert _cosines(got, want).min() >= 0.99999

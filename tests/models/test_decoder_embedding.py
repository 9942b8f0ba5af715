"""Decoder embedders (Qwen3-Embedding / e5-mistral style: last-token pooling over a decoder) against
transformers' last hidden state, on tiny random checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from engine_fixtures import run_cache_dir
from tiny_models import VARIANTS, make_tiny_checkpoint

from jaxserve.llm import LLM
from jaxserve.pooling_params import PoolingParams

PROMPTS = [[0, 5, 9, 200, 31], [0, 7], list(range(2, 60)), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def _bare_decoder_with_modules(path):
    """A Qwen3-Embedding-like directory: the bare Qwen3Model (no `model.` prefix, no LM head) with a
    sentence-transformers last-token pooling and Normalize."""
    make_tiny_checkpoint(path, "qwen3", **VARIANTS["qwen3_qknorm"][1])
    bare = AutoModel.from_pretrained(path, dtype=torch.float32)
    bare.save_pretrained(path)  # overwrites model.safetensors with the bare names
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    )
    return path


def _hf_last_hidden(path, ids) -> np.ndarray:  # [D]
    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


@pytest.mark.parametrize("kind", ["bare_qwen3_with_modules", "llama_causal_lm"])
def test_last_token_pooling_equals_hf(tmp_path, kind):
    if kind == "bare_qwen3_with_modules":
        path = _bare_decoder_with_modules(tmp_path / "qwen3emb")
        kwargs = {}  # runner picked from modules.json
    else:
        path = make_tiny_checkpoint(tmp_path / "llama", "llama")
        kwargs = {"task": "embed"}  # vLLM's older spelling of runner="pooling"
    # Rows of 64 tokens, four to a step: the prompts share rows and attention stays within each row.
    llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_batched_tokens=256, compilation_cache_dir=run_cache_dir(),
              precompile="none", use_tqdm_on_load=False, **kwargs)  # fmt: skip
    info = llm.llm_engine.info()
    assert (info["pooling_type"], info["attention_row_len"]) == ("last", 64)
    raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False), use_tqdm=False)
    normed = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for ids, r, n in zip(PROMPTS, raw, normed):
        want = _hf_last_hidden(path, ids)
        np.testing.assert_allclose(r.outputs.embedding, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(n.outputs.embedding, want / np.linalg.norm(want), rtol=1e-4, atol=1e-5)
    alone = llm.embed({"prompt_token_ids": PROMPTS[2]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(alone.outputs.embedding, raw[2].outputs.embedding, rtol=1e-5, atol=1e-5)


def test_generate_model_refuses_embed(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    llm = LLM(str(path), dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
              compilation_cache_dir=run_cache_dir(), precompile="none", use_tqdm_on_load=False)  # fmt: skip
    with pytest.raises(ValueError, match="runs as a generative model, which does not embed.*runner='pooling'"):
        llm.embed("hello")


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=64, compilation_cache_dir=run_cache_dir(),
              precompile="none", use_tqdm_on_load=False)  # fmt: skip
    ids = {"prompt_token_ids": PROMPTS[0]}
    full = np.array(llm.embed(ids, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding)
    short = llm.embed(ids, PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"dimensions=8 is invalid for this model: choose one of \[16, 32\]"):
        llm.embed(ids, PoolingParams(dimensions=8), use_tqdm=False)

"""all-MiniLM-L6-v2 through LLM.embed against sentence-transformers' own embeddings (cosine >= 0.9999)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from engine_fixtures import run_cache_dir
from embedding_fixtures import minilm_path, sentences

from jaxserve.llm import LLM
from jaxserve.pooling_params import PoolingParams


@pytest.fixture(scope="module")
def path():
    return minilm_path()


@pytest.fixture(scope="module")
def reference(path):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(path, device="cpu")
    return model.encode(sentences(), batch_size=16, convert_to_numpy=True)  # [64, 384], unit length


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_num_batched_tokens=512, compilation_cache_dir=run_cache_dir(), use_tqdm_on_load=False)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_runner_and_pooling_come_from_the_checkpoint(llm):
    info = llm.llm_engine.info()
    assert info["runner"] == "pooling" and info["pooling_type"] == "mean" and info["normalize"]
    assert info["max_model_len"] == 256  # sentence_bert_config.json's max_seq_length


def test_batched_matches_sentence_transformers(llm, reference):
    outs = llm.embed(sentences(), use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == reference.shape
    cos = _cosines(got, reference)
    assert cos.min() >= 0.9999, (cos.min(), int(cos.argmin()))
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def test_alone_matches_batched(llm, reference):
    texts = sentences()
    for i in range(0, len(texts), 4):  # every 4th alone keeps the test fast; lengths still span the buckets
        got = np.array(llm.embed(texts[i], use_tqdm=False)[0].outputs.embedding)
        assert _cosines(got, reference[i]) >= 0.9999, i


_COMPILES: list[str] | None = None


def _on_event(name: str, *args, **kwargs) -> None:
    if _COMPILES is not None and name.startswith("/jax/core/compile/"):
        _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


def test_steady_state_compiles_nothing(llm):
    """Every token bucket was compiled at start-up: batches of any mix of lengths trace nothing new."""
    global _COMPILES
    _COMPILES = events = []
    try:
        llm.embed(sentences(20, seed=3) + [" ".join(["word"] * 250)], use_tqdm=False, truncate_prompt_tokens=-1)
    finally:
        _COMPILES = None
    assert events == []


def test_truncation_errors_and_truncate_prompt_tokens(llm):
    long_text = " ".join(["word"] * 400)
    with pytest.raises(ValueError, match="max_model_len=256.*truncate_prompt_tokens"):
        llm.embed(long_text, use_tqdm=False)
    out = llm.embed(long_text, use_tqdm=False, truncate_prompt_tokens=-1)[0]
    assert len(out.prompt_token_ids) == 256
    assert out.prompt_token_ids[0] == 101 and out.prompt_token_ids[-1] == 102  # [CLS] ... [SEP] kept
    ids = list(range(1000, 1300))
    assert llm.embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=8), use_tqdm=False)[
        0
    ].prompt_token_ids == ids[-8:]


def test_dimensions_need_a_matryoshka_model(llm):
    with pytest.raises(ValueError, match="dimensions=32 is invalid.*Matryoshka"):
        llm.embed("hello", PoolingParams(dimensions=32), use_tqdm=False)


def test_generate_on_an_embedding_model_says_why(llm):
    with pytest.raises(ValueError, match="cannot generate text: call LLM.embed"):
        llm.generate("hello")

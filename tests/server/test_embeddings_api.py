"""/v1/embeddings through the official `openai` client, on a real server over all-MiniLM-L6-v2."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import requests

from engine_fixtures import run_cache_dir
from embedding_fixtures import minilm_path
from tiny_models import make_tiny_checkpoint

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

TEXTS = ["A serving engine batches requests.", "The quick brown fox jumps over the lazy dog near the river."]


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(
        model=minilm_path(), served_model_name="minilm", compilation_cache_dir=run_cache_dir(), max_num_batched_tokens=256
    )
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_float_matches_sentence_transformers_and_counts_usage(client):
    st = pytest.importorskip("sentence_transformers")
    want = st.SentenceTransformer(minilm_path(), device="cpu").encode(TEXTS)
    resp = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in resp.data])
    assert [d.index for d in resp.data] == [0, 1] and resp.model == "minilm"
    assert (got * want).sum(-1).min() >= 0.9999
    tok = st.SentenceTransformer(minilm_path(), device="cpu").tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == n and resp.usage.total_tokens == n


def test_base64_decodes_to_the_float_embedding(client):
    floats = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float").data[0].embedding
    raw = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="base64").data[0].embedding
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    np.testing.assert_allclose(decoded, floats, rtol=1e-6)
    # Without encoding_format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model="minilm", input=TEXTS[0]).data[0].embedding
    np.testing.assert_allclose(default, floats, rtol=1e-6)


def test_token_id_inputs(client):
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    one = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    text = client.embeddings.create(model="minilm", input="hello world", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    many = client.embeddings.create(model="minilm", input=[ids, ids[:3]], encoding_format="float")
    assert len(many.data) == 2 and many.usage.prompt_tokens == 7


def test_truncate_prompt_tokens(client):
    resp = client.embeddings.create(
        model="minilm", input="word " * 400, encoding_format="float", extra_body={"truncate_prompt_tokens": -1}
    )
    assert resp.usage.prompt_tokens == 256


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input": []}, "input must be a non-empty"),
        ({"input": [1, "a"]}, "input must be a non-empty"),
        ({"input": ""}, "input must not contain empty strings"),
        ({"input": [[]]}, "input must be a non-empty"),
        ({"input": [99999999]}, "outside the vocabulary"),
        ({"input": "word " * 400}, "max_model_len=256"),
        ({"input": "hi", "dimensions": 8}, "Matryoshka"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "model": "other"}, "does not exist"),
    ],
)
def test_bad_inputs_get_400_or_404(server, body, fragment):
    r = requests.post(server.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == (404 if "model" in body else 400), r.text
    assert fragment in r.json()["error"]["message"]


def test_generate_routes_on_an_embedding_server_say_why(client):
    with pytest.raises(openai.BadRequestError, match="embedding model.*cannot generate text.*/v1/embeddings"):
        client.completions.create(model="minilm", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="cannot generate text"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])


def test_embeddings_on_a_generate_server_say_why(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    args = EngineArgs(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=64, max_num_batched_tokens=32,
        max_num_seqs=4, block_size=8, compilation_cache_dir=run_cache_dir(), precompile="none",
    )  # fmt: skip
    with ServerThread(AsyncLLMEngine.from_engine_args(args, progress=False)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="generative model.*--runner pooling"):
            client.embeddings.create(model="tiny", input="hello")

"""Prompt logprobs through the official `openai` client: completions' echo with logprobs (and max_tokens=0, the
prompt alone, as evaluation harnesses score text), and vLLM's ``prompt_logprobs`` field on both endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine_fixtures import run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    args = EngineArgs(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=128,
        max_num_batched_tokens=16, max_num_seqs=8, block_size=8, compilation_cache_dir=run_cache_dir(),
    )  # a 16-token budget: the prompts are computed in chunks
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _tokens(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_with_logprobs_scores_prompt_then_output(client, server):
    prompt_ids = _tokens(server, PROMPT)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                     extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    for token, token_lp, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == token_lp and len(top) <= 3  # the token itself and its 2 best alternatives
    assert lp.text_offset[n] == len(PROMPT)  # the output's offsets continue after the echoed text
    assert resp.usage.completion_tokens == 3


def test_max_tokens_zero_returns_the_prompt_alone(client, server):
    resp = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [PROMPT, "Hello"]
    for c, text in zip(sorted(resp.choices, key=lambda c: c.index), [PROMPT, "Hello"]):
        assert len(c.logprobs.tokens) == len(_tokens(server, text))
        assert c.finish_reason == "length"
    assert resp.usage.completion_tokens == 0


def test_echo_logprobs_stream_in_the_first_chunk(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                      extra_body={"ignore_eos": True})
    chunks = [c for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                                   logprobs=1, stream=True, extra_body={"ignore_eos": True})
              if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    expected = plain.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and expected[0] is None
    assert streamed[1:] == pytest.approx(expected[1:], abs=1e-5)


def test_prompt_logprobs_field_on_both_endpoints(client, server):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = _tokens(server, PROMPT)
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for token, entry in zip(prompt_ids[1:], plp[1:]):
        assert str(token) in entry and len(entry) <= 3  # JSON keys are strings
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(token)])
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    assert [e[str(t)]["logprob"] for t, e in zip(prompt_ids[1:], plp[1:])] == pytest.approx(
        echoed.choices[0].logprobs.token_logprobs[1:], abs=1e-5)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert len(chat_plp) == chat.usage.prompt_tokens and chat_plp[0] is None
    assert all(len(e) == 1 for e in chat_plp[1:])
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1).model_extra.get("prompt_logprobs") is None

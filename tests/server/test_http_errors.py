"""Raw HTTP against a real server with an API key and a small waiting queue: every bad input answers the
right status with an OpenAI error body and the server keeps serving; dropped clients free their requests."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from engine_fixtures import run_cache_dir
from server_probes import metric, slow_steps, wait_idle
from tiny_models import make_tiny_checkpoint

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

KEY = "sk-test-key"
MAX_WAITING = 2
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    args = EngineArgs(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=512,
        max_num_batched_tokens=32, max_num_seqs=2, block_size=8, compilation_cache_dir=run_cache_dir(),
    )
    engine = AsyncLLMEngine.from_engine_args(args, progress=False, max_waiting_requests=MAX_WAITING)
    with ServerThread(engine, api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param: str | None = None, match: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if match is not None:
        assert re.search(match, err["message"]), err["message"]
    return err


def still_serves(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def aborted(http: httpx.Client) -> float:
    return metric(http, "jaxserve:request_success_total", finished_reason="abort")


# ---------------------------------------------------------------- auth


def test_v1_routes_need_the_key(server):
    url = server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
        assert_error(r, 401)
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401)
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200


# ---------------------------------------------------------------- bad input


BAD_BODIES = [
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 200}}, "logit_bias"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}},
     "logit_bias"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [5, 99999999]}, "allowed_token_ids"),
    ("completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "bad_words": [""]}, "bad_words"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "hi", "min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ("completions", {"prompt": 42}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": [1, 2, 100000]}, None),  # token id outside the vocabulary
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD_BODIES)
def test_invalid_fields_are_400_naming_the_field(http, endpoint, body, param):
    err = assert_error(http.post(f"/v1/{endpoint}", json=body), 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_is_400_and_the_server_still_serves(http):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        assert_error(http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
    still_serves(http)


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, param="model")
    assert err["code"] == "model_not_found"
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404, param="model")


def test_too_long_for_the_context_is_400_with_the_numbers(http):
    err = assert_error(
        http.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 30}), 400, param="max_tokens"
    )
    for number in ("512", "530", "500", "30"):
        assert number in err["message"], err["message"]
    assert_error(http.post("/v1/completions", json={"prompt": [5] * 512}), 400, param="prompt", match="512")
    chat = {"messages": [{"role": "user", "content": "word " * 600}], "max_completion_tokens": 4}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, param="messages", match="512")
    still_serves(http)


def test_unknown_path_and_method_use_the_error_body(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_bad_requests_do_not_disturb_a_running_stream(http):
    body = {"prompt": "Once upon a time", "max_tokens": 24, "stream": True, "ignore_eos": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for bad in BAD_BODIES[:6]:
            assert http.post(f"/v1/{bad[0]}", json=bad[1]).status_code == 400
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- clients that go away


@pytest.fixture
def slow(server, monkeypatch):
    # The tiny model alone can finish 400 tokens inside the 0.3 s client timeout used below.
    slow_steps(monkeypatch, server.engine.engine)


def test_dropped_stream_is_aborted(http, slow):
    before = aborted(http)
    body = {"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        data = [line for _, line in zip(range(6), resp.iter_lines())]
        assert any(line.startswith("data: ") for line in data)
    # Leaving the block closes the connection mid-stream.
    wait_idle(http)
    assert aborted(http) == before + 1
    assert metric(http, "jaxserve:kv_cache_usage_perc") == 0
    still_serves(http)


def test_dropped_plain_request_is_aborted(server, http, slow):
    before = aborted(http)
    body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.3)
    wait_idle(http)
    assert aborted(http) == before + 1
    still_serves(http)


# ---------------------------------------------------------------- overload


def test_full_waiting_queue_answers_503_at_once(server, http):
    async def one(client: httpx.AsyncClient):
        body = {"prompt": "count", "max_tokens": 48, "ignore_eos": True}
        return await client.post("/v1/completions", json=body)

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 503 in codes and 200 in codes, codes
    assert set(codes) == {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert assert_error(r, 503)["code"] == "queue_full"
    wait_idle(http)
    still_serves(http)


# ---------------------------------------------------------------- the other routes


def test_tokenize_detokenize_version_openapi(http):
    tok = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("hello world")
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, param="tokens")
    assert http.get("/version").json()["version"]
    spec = http.get("/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "CompletionRequest" in spec["components"]["schemas"]


def test_metrics_count_tokens_and_latencies(http):
    before = metric(http, "jaxserve:generation_tokens_total")
    prompt_before = metric(http, "jaxserve:prompt_tokens_total")
    resp = http.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 5, "ignore_eos": True}).json()
    assert resp["usage"]["completion_tokens"] == 5
    assert metric(http, "jaxserve:generation_tokens_total") == before + 5
    assert metric(http, "jaxserve:prompt_tokens_total") == prompt_before + 3
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric(http, f"jaxserve:{name}_count") >= 1


def test_metrics_describe_the_kv_cache(server, http):
    """vLLM's cache_config_info: the KV cache as built (blocks, block size, dtype) in the gauge's labels."""
    info = server.engine.engine.info()
    labels = {"num_gpu_blocks": str(info["num_kv_blocks"]), "block_size": str(info["block_size"]),
              "cache_dtype": info["kv_cache_dtype"]}  # fmt: skip
    assert metric(http, "jaxserve:cache_config_info", **labels) == 1.0

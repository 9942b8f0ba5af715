"""Chat completions with image_url parts on a tiny Qwen2-VL: a data-URL image through the official `openai`
client (tokens equal HF generate's), a local file only under --allowed-local-media-path, and bad images
answered 400 with an OpenAI error body while the server carries on."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from engine_fixtures import run_cache_dir
from tiny_qwen2_vl import IMG, hf_greedy, image, tiny_qwen2_vl

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    image(56, 84, 11).save(d / "ok.png")
    return d


@pytest.fixture(scope="module")
def server(media_dir):
    args = EngineArgs(
        model=tiny_qwen2_vl(), served_model_name="tiny-vl", dtype="float32", max_model_len=256,
        max_num_batched_tokens=32, max_num_seqs=8, block_size=4, compilation_cache_dir=run_cache_dir(), precompile="none",
        allowed_local_media_path=str(media_dir), limit_mm_per_prompt="image=2",
    )  # fmt: skip
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine) as srv:
        yield srv


def _data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip


def test_data_url_image_through_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    img = image(84, 56, 10)
    resp = client.chat.completions.create(
        model="tiny-vl", messages=_messages(_data_url(img)), max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    # The prompt as the server rendered it: the template's text around 6 image tokens.
    prompt = httpx.post(server.url + "/tokenize", json={"messages": _messages(_data_url(img))}).json()["tokens"]
    i = prompt.index(IMG)
    prompt = prompt[:i] + [IMG] * 6 + prompt[i + 1 :]
    assert resp.usage.prompt_tokens == len(prompt)
    want = hf_greedy(tiny_qwen2_vl(), prompt, [img], 5)
    assert resp.choices[0].message.content == httpx.post(server.url + "/detokenize", json={"tokens": want}).json()["prompt"]
    # The Responses API's input_image part: the same image, the same reply.
    again = client.responses.create(model="tiny-vl", max_output_tokens=5, temperature=0, extra_body={"ignore_eos": True},
                                    input=[{"role": "user", "content": [
                                        {"type": "input_text", "text": "what is"},
                                        {"type": "input_image", "image_url": _data_url(img)}]}])
    assert again.output_text == resp.choices[0].message.content and again.usage.input_tokens == len(prompt)


def test_local_file_only_under_allowed_dir(server, media_dir, tmp_path):
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                    json={"messages": _messages(f"file://{media_dir}/ok.png"), "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200, ok.text
    image(56, 56).save(tmp_path / "outside.png")
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                     json={"messages": _messages(str(tmp_path / "outside.png")), "max_tokens": 2})  # fmt: skip
    assert bad.status_code == 400 and "outside" in bad.json()["error"]["message"]


@pytest.mark.parametrize("url, says", [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "could not be decoded"),  # "not an image"
    ("data:image/png;base64,", "empty"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "network fetches are off"),
    ("tiff", "format TIFF is not supported"),
])  # fmt: skip
def test_bad_images_are_400_and_the_server_carries_on(server, url, says):
    if url == "tiff":
        url = _data_url(image(8, 8), "TIFF")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": _messages(url), "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["param"] == "messages" and err["code"] == "invalid_image", err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200

"""A reasoning model through the official `openai` client: `--reasoning-parser qwen3` gives the <think> block as
the message's "reasoning" (and "reasoning_content"), streamed or not, with tool calls and chat_template_kwargs.

The tiny model does not think on its own: a regex writes its replies, which needs the server's
--structured-outputs-in-reasoning (else the regex would wait for a </think> the model never writes; the engine's
tests cover that gate)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from server_fixtures import thinking_client, thinking_server  # noqa: F401 (the fixtures server, client)


MESSAGES = [{"role": "user", "content": "Name a fruit."}]
# llguidance takes added tokens written <...> as special tokens, which a Lark grammar names and a regex cannot.
THOUGHT = r"<think> /[a-z ]{4,12}/ </think> "
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}


def _create(client, grammar, **kw):
    """A reply written by ``grammar`` (a Lark rule's body)."""
    extra = {"structured_outputs": {"grammar": "start: " + grammar}, **kw.pop("extra_body", {})}
    return client.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
                                             "extra_body": extra, **kw})


def _joined(chunks) -> tuple[str, str]:
    """(reasoning, content) as a client joins them from the deltas."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return ("".join(getattr(d, "reasoning", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas))


def test_reasoning_apart_from_the_answer(client):
    choice = _create(client, THOUGHT + "/[a-z]{3,6}/").choices[0]
    msg = choice.message
    assert re.fullmatch(r"[a-z ]{4,12}", msg.reasoning) and re.fullmatch(r"[a-z]{3,6}", msg.content), msg
    assert msg.reasoning_content == msg.reasoning  # vLLM's older name, for older clients
    chunks = list(_create(client, THOUGHT + "/[a-z]{3,6}/", stream=True))
    assert _joined(chunks) == (msg.reasoning, msg.content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # include_reasoning=false (vLLM's field) leaves the block out; the answer stays.
    hidden = _create(client, THOUGHT + "/[a-z]{3,6}/", extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.reasoning is None and hidden.content == msg.content
    assert _joined(_create(client, THOUGHT + "/[a-z]{3,6}/", stream=True, extra_body={"include_reasoning": False})) == \
        ("", msg.content)
    # A reply cut while it reasons has no answer yet.
    cut = _create(client, '<think> /[a-z ]{30,40}/ </think> "x"', max_tokens=4).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and cut.message.reasoning


def test_thinking_switched_off_through_chat_template_kwargs(client):
    """enable_thinking=false closes an empty block in the prompt: the whole reply is the answer."""
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = _create(client, "/[a-z]{3,6}/", extra_body=extra).choices[0].message
    assert msg.reasoning is None and re.fullmatch(r"[a-z]{3,6}", msg.content)
    chunks = list(_create(client, "/[a-z]{3,6}/", stream=True, extra_body=extra))
    assert _joined(chunks) == ("", msg.content)


def test_reasoning_then_a_tool_call(client):
    call = r'/<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}"\}\}<\/tool_call>/'
    kw = dict(tools=[WEATHER_TOOL], max_tokens=90)
    choice = _create(client, THOUGHT + call, **kw).choices[0]
    (made,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.reasoning
    assert made.function.name == "get_weather" and re.fullmatch(r'\{"city": "[a-z]{1,5}"\}', made.function.arguments)
    chunks = list(_create(client, THOUGHT + call, stream=True, **kw))
    assert _joined(chunks) == (choice.message.reasoning, "")
    args = "".join(d.function.arguments or "" for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [])
    assert args == made.function.arguments


def test_chat_template_kwargs_on_tokenize_and_their_errors(server):
    body = {"model": "tiny", "messages": MESSAGES}
    on = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    off = httpx.post(server.url + "/tokenize", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.json()["tokens"][: len(on)] == on and len(off.json()["tokens"]) > len(on)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "may not set ['tokenize']" in r.json()["error"]["message"]

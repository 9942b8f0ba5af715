"""OpenAI's Responses API (POST /v1/responses) through the official `openai` client: text, streamed events, reasoning
items, function calls, structured text, and conversations continued by previous_response_id.

Every body and stream event is also checked against the `openai` package's own types, strictly (the client itself
builds its objects without validation). The server reads a reasoning model's blocks (qwen3) and hermes tool calls;
the tiny model's replies are steered by grammars, as in test_reasoning_api.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_fixtures import thinking_client, thinking_server  # noqa: F401 (the fixtures server, client)
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THOUGHT = "<think> /[a-z ]{4,12}/ </think> "
CALL = r'/<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}"\}\}<\/tool_call>/'
EVENTS = TypeAdapter(ResponseStreamEvent)


def _post(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # strictly, by the openai package's own type
    return r.json()


def _events(server, **body) -> list[dict]:
    out = []
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60,
                      json={"model": "tiny", "temperature": 0, "stream": True, **body}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                EVENTS.validate_python(event)
                out.append(event)
    return out


def test_text_as_chat_writes_it(server, client):
    """The same greedy reply as chat gives for the instructions and input as messages."""
    resp = client.responses.create(model="tiny", instructions="Be brief.", input="Name a fruit.", max_output_tokens=12,
                                   temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens and resp.usage.output_tokens == 12
    body = _post(server, instructions="Be brief.", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Name a fruit."}]}], max_output_tokens=12)
    assert body["output"][0]["content"][0]["text"] == resp.output_text and body["instructions"] == "Be brief."
    # The same prompt a third time: its whole blocks (8 tokens each) come from the prefix cache.
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == resp.usage.input_tokens // 8 * 8 or \
        body["usage"]["input_tokens_details"]["cached_tokens"] == (resp.usage.input_tokens - 1) // 8 * 8


def test_stream_events_build_the_same_response(server):
    kw = dict(input="Name a fruit.", max_output_tokens=30,
              structured_outputs={"grammar": "start: " + THOUGHT + "/[a-z]{3,6}/"})
    whole = _post(server, **kw)
    events = _events(server, **kw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    strip = lambda items: [{k: v for k, v in i.items() if k != "id"} for i in items]  # noqa: E731
    assert strip(final["output"]) == strip(whole["output"])
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        reasoning["content"][0]["text"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
        message["content"][0]["text"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_function_call_and_its_output(server, client):
    grammar = {"grammar": "start: " + THOUGHT + CALL}
    resp = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=90,
                                   temperature=0, extra_body={"structured_outputs": grammar})
    kinds = [o.type for o in resp.output]
    assert kinds == ["reasoning", "function_call"] and resp.status == "completed", resp.output
    call = resp.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    events = _events(server, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=90,
                     structured_outputs=grammar)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == call.arguments
    # The next turn sends the call's output; the conversation (input, the call, its output) reaches the template.
    follow = client.responses.create(model="tiny", previous_response_id=resp.id, max_output_tokens=4, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C and sunny"}])
    assert follow.previous_response_id == resp.id
    assert follow.usage.input_tokens > resp.usage.input_tokens + 5  # (this template shows no calls, only content)


def test_stored_responses(server, client):
    first = client.responses.create(model="tiny", input="Name a fruit.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="tiny", input="Hi.", max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="Again.", previous_response_id=unstored.id, max_output_tokens=2)


def test_structured_text_format(client):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 8}}, "required": ["fruit"],
              "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="Name a fruit as JSON.", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}},
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert set(json.loads(resp.output_text)) == {"fruit"} and resp.text.format.type == "json_schema"


def test_logprobs_of_the_answer_tokens(server, client):
    """include=["message.output_text.logprobs"]: each answer token's logprob with top_logprobs alternatives, beside
    the text; the reasoning block's tokens have none. A stream's deltas carry the same ones, in order."""
    kw = dict(input="Name a fruit.", max_output_tokens=30, include=["message.output_text.logprobs"], top_logprobs=2,
              structured_outputs={"grammar": "start: " + THOUGHT + "/[a-z]{3,6}/"})
    whole = _post(server, **kw)
    assert whole["top_logprobs"] == 2
    reasoning, message = whole["output"]
    part = message["content"][0]
    lps = part["logprobs"]
    assert lps and "".join(lp["token"] for lp in lps).strip() == part["text"]
    assert len(lps) < whole["usage"]["output_tokens"] - whole["usage"]["output_tokens_details"]["reasoning_tokens"] + 1
    for lp in lps:
        assert lp["logprob"] <= 0 and 1 <= len(lp["top_logprobs"]) <= 2 and lp["bytes"] == list(lp["token"].encode())
        assert lp["top_logprobs"][0]["logprob"] >= lp["top_logprobs"][-1]["logprob"]
    events = _events(server, **kw)
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert deltas == done["logprobs"] == lps
    # Without reasoning every output token is the answer's; without include there are none.
    plain = client.responses.create(model="tiny", input="Name a fruit.", max_output_tokens=6, temperature=0,
                                    include=["message.output_text.logprobs"],
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert len(plain.output[0].content[0].logprobs) == plain.usage.output_tokens == 6
    assert all(lp.top_logprobs == [] for lp in plain.output[0].content[0].logprobs)  # top_logprobs unset: none
    bare = client.responses.create(model="tiny", input="Name a fruit.", max_output_tokens=6, temperature=0,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert bare.output[0].content[0].logprobs == [] and bare.output_text == plain.output_text


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"n": 2}, "n"),
    ({"include": ["message.output_text.logprobs", "everything"]}, "include"),
    ({"max_output_tokens": 500}, "max_output_tokens"),
    ({"input": ""}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi.", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi.", "previous_response_id": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"

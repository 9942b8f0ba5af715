"""The server through the official `openai` client: a real uvicorn on loopback over a tiny llama checkpoint."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from server_fixtures import openai_client, serve_tiny
from tiny_models import make_tiny_checkpoint



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_counts_usage(client):
    resp = client.completions.create(
        model="tiny", prompt="Hello world", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.object == "text_completion"
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    echoed = client.completions.create(model="tiny", prompt="Hello world", max_tokens=2, echo=True, temperature=0)
    assert echoed.choices[0].text.startswith("Hello world")


def test_completion_default_max_tokens_is_16(client):
    resp = client.completions.create(model="tiny", prompt="The weather", extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16


def test_chat_with_system_user_assistant_turns(client):
    resp = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "How are you today?"}]},
        ],
        max_completion_tokens=5,
        temperature=0,
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 5
    # The template wraps each turn; the prompt is longer than the raw words.
    assert resp.usage.prompt_tokens > 20


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_deltas_join_to_the_plain_text(client, endpoint):
    common = dict(model="tiny", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    if endpoint == "completions":
        plain = client.completions.create(prompt="Once upon a time", **common).choices[0].text
        stream = client.completions.create(
            prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **common
        )
        chunks = list(stream)
        joined = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        messages = [{"role": "user", "content": "Tell me a story"}]
        plain = client.chat.completions.create(messages=messages, **common).choices[0].message.content
        stream = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
        chunks = list(stream)
        joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    assert joined == plain
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_n2_with_seed_is_reproducible(client):
    kw = dict(
        model="tiny", prompt="apple banana", n=2, seed=1234, temperature=1.0, max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # the samples differ from each other
    assert first.usage.completion_tokens == 24


def test_stop_string_ends_the_text_before_it(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    clean = [i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 2]]
    assert clean, f"no usable stop string in {text!r}"
    stop = text[clean[0] : clean[0] + 2]
    expected = text[: text.index(stop)]
    resp = client.completions.create(stop=[stop], **kw)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == expected


def test_completion_logprobs(client):
    resp = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert token_lp == pytest.approx(max(top.values()))


def test_chat_logprobs_with_top_logprobs(client):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_logit_bias_on_both_endpoints(client):
    forced = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    token = client.completions.create(model="tiny", prompt=[1, 2, 42], max_tokens=1, temperature=0, echo=True,
                                      logprobs=0, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens[2]
    assert forced.choices[0].text == token * 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"42": 100}, logprobs=True)
    assert [t.token for t in chat.choices[0].logprobs.content] == [token] * 3
    assert all(t.logprob < 0 for t in chat.choices[0].logprobs.content)  # the model's own logprobs, not biased


def test_allowed_token_ids_and_bad_words_on_both_endpoints(client):
    """vLLM's extras, through the client's extra_body: streamed and not, completions and chat."""
    tokens = client.completions.create(model="tiny", prompt=[1, 2, 42, 43], max_tokens=1, temperature=0, echo=True,
                                       logprobs=0).choices[0].logprobs.tokens[2:4]
    allowed = {"allowed_token_ids": [42, 43], "ignore_eos": True}
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=1,
                                     extra_body=allowed, logprobs=0)
    assert set(resp.choices[0].logprobs.tokens) <= set(tokens) and resp.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True, extra_body=allowed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                           temperature=0, extra_body=allowed).choices[0].message.content
    assert text == whole and whole.replace(tokens[0], "").replace(tokens[1], "") == ""
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0, logprobs=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    i, word = next((i, t) for i, t in enumerate(plain) if t.strip().isalpha())  # a word the tiny model writes
    banned = client.completions.create(**kw, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0]
    assert banned.logprobs.tokens[:i] == plain[:i] and word not in banned.logprobs.tokens, (word, plain)


def test_chat_continue_final_message(client, server):
    import httpx

    messages = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, I am"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    open_ids = httpx.post(server.url + "/tokenize", json={"messages": messages, **cont}).json()["tokens"]
    closed_ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert len(open_ids) < len(closed_ids) and closed_ids[: len(open_ids)] == open_ids
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={**cont, "ignore_eos": True})
    assert resp.usage.prompt_tokens == len(open_ids)
    same = client.completions.create(model="tiny", prompt=open_ids, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == same.choices[0].text
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt=False"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"continue_final_message": True})


def test_token_id_prompts_and_prompt_lists(client):
    resp = client.completions.create(
        model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 12
    texts = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=2, temperature=0)
    assert len(texts.choices) == 2


def test_32_concurrent_streams_all_complete(server):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model="tiny", prompt=f"Request number {i}", max_tokens=8 + i % 5, temperature=0.7, seed=i,
            stream=True, extra_body={"ignore_eos": True},
        )
        finish, text = None, ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return finish

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))
        finally:
            await aclient.close()

    finishes = asyncio.run(run_all())
    assert finishes == ["length"] * 32


def test_unknown_model_is_a_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_bench_serve_against_the_server(server, tmp_path):
    from jaxserve.cli import build_parser

    out = tmp_path / "result.json"
    ns = build_parser().parse_args([
        "bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "12",
        "--random-output-len", "5", "--max-concurrency", "3", "--endpoint", "chat", "--result-json", str(out),
    ])
    assert ns.func(ns) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 30
    assert result["ttft_ms"]["mean"] > 0 and result["itl_ms"]["median"] > 0
    assert result["peak_concurrent_requests"] <= 3


# ---- structured outputs: OpenAI's response_format (json_schema, json_object) on chat and completions, vLLM's
# structured_outputs and guided_* fields, and clear 400s for bad constraints

SO_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
SO_MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]


def _fits_verdict(text: str) -> None:
    value = json.loads(text)
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and set(value) == {"answer", "score"}


def test_chat_json_schema_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SO_SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model="tiny", messages=SO_MESSAGES, response_format=fmt, max_tokens=64,
                                          temperature=0.8, seed=1, n=2)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        _fits_verdict(choice.message.content)
    stream = client.chat.completions.create(model="tiny", messages=SO_MESSAGES, response_format=fmt, max_tokens=64,
                                            temperature=0, stream=True)
    chunks = list(stream)
    _fits_verdict("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_the_clients_parse_helper_with_a_pydantic_model(client):
    """openai's chat.completions.parse sends the model's JSON schema (strict) and parses the answer back."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    resp = client.chat.completions.parse(model="tiny", messages=SO_MESSAGES, response_format=Verdict, max_tokens=64,
                                         temperature=0)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.answer in ("yes", "no")


def test_chat_json_object(client):
    resp = client.chat.completions.create(model="tiny", messages=SO_MESSAGES, response_format={"type": "json_object"},
                                          max_tokens=32, temperature=0)
    choice = resp.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_completions_vllm_fields(client):
    resp = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=16, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert resp.choices[0].text in ("red", "green", "blue") and resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model="tiny", prompt="Call", max_tokens=16, temperature=0,
                                     extra_body={"guided_regex": r"[0-9]{3}-[0-9]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", resp.choices[0].text)
    resp = client.completions.create(model="tiny", prompt="Verdict:", max_tokens=64, temperature=0,
                                     extra_body={"guided_json": SO_SCHEMA})
    _fits_verdict(resp.choices[0].text)
    resp = client.completions.create(model="tiny", prompt="Verdict:", max_tokens=64, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "v", "schema": SO_SCHEMA}}})
    _fits_verdict(resp.choices[0].text)


@pytest.mark.parametrize("extra,param,match", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "does not compile"),
    ({"structured_outputs": {"regexp": "a"}}, None, "unknown field"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "with guided_choice: ask for one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, match):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=SO_MESSAGES, max_tokens=8, extra_body=extra)
    body = e.value.body
    assert re.search(match, body["message"]), body
    assert body.get("param") == param, body
    ok = client.chat.completions.create(model="tiny", messages=SO_MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None  # the server goes on serving


# ---- tool calling: a named function and "required" generate under the tools' schemas, "auto" reads hermes-style
# calls out of the text (the tiny model writes none: its reply stays content), and the conversation goes on with
# the calls and their results

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                   "additionalProperties": False},
}}
TIME_TOOL = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(stream) -> tuple[dict, list]:
    """The openai client's way to join streamed tool calls: by index, arguments concatenated."""
    calls, reasons = {}, []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    return calls, [r for r in reasons if r]


def test_named_tool_choice_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                          tool_choice=named, max_tokens=48, temperature=0)
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's answer for a named function
    calls, reasons = _streamed_calls(client.chat.completions.create(
        model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, max_tokens=48,
        temperature=0, stream=True))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert reasons == ["stop"]


def test_required_tool_choice_and_the_next_turn(client):
    resp = client.chat.completions.create(model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=64,
                                          temperature=0.9, seed=3, n=2)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "now") and isinstance(json.loads(call.function.arguments), dict)
    # The client sends the calls back with their results, and the model answers in plain text.
    message = resp.choices[0].message
    follow_up = TOOL_MESSAGES + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in message.tool_calls
    ]
    nxt = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER_TOOL], tool_choice="none",
                                         max_tokens=4, temperature=0)
    assert nxt.choices[0].message.tool_calls is None and nxt.choices[0].message.content is not None
    # Parallel calls, streamed: a random model may go on calling until max_tokens, so "length" is fine here.
    kw = dict(model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
              max_tokens=64, temperature=0)
    calls, reasons = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    whole = client.chat.completions.create(**kw).choices[0]
    assert calls and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert reasons == [whole.finish_reason] and whole.finish_reason in ("tool_calls", "length")


def test_auto_tool_choice_without_a_call_is_content(client):
    """The server reads hermes calls; the tiny model writes none, so "auto" answers what "none" answers."""
    kw = dict(model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL], max_tokens=6, temperature=0)
    auto, none = client.chat.completions.create(**kw), client.chat.completions.create(tool_choice="none", **kw)
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_reads_a_hermes_call(client):
    """A regex makes the tiny model write a hermes call after some content; "auto" reads it out, streamed or not."""
    regex = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}"\}\}</tool_call>'
    kw = dict(model="tiny", messages=TOOL_MESSAGES, tools=[WEATHER_TOOL], max_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and re.fullmatch(r'\{"city": "[a-z]{1,5}"\}', call.function.arguments)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure."
    calls, reasons = _streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    assert reasons == ["tool_calls"]


def test_tools_reach_the_chat_template(server):
    import httpx

    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"messages": TOOL_MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL], "chat_template": template,
            "add_generation_prompt": False}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "get_weather" in text and "now" in text


@pytest.mark.parametrize("extra,param,match", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "no function named 'nope'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one output constraint"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "two functions are named"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param, match):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=TOOL_MESSAGES, max_tokens=8,
                                       **{"tools": [WEATHER_TOOL], **extra})
    assert re.search(match, e.value.body["message"]) and e.value.body.get("param") == param, e.value.body


@pytest.fixture
def prompt_details(server):
    """The running server as --enable-prompt-tokens-details would build it, for one test."""
    state = server.app.state.jaxserve
    state.enable_prompt_tokens_details = True
    yield
    state.enable_prompt_tokens_details = False


def test_usage_reports_cached_prompt_tokens_when_enabled(client, prompt_details):
    # A 40-token prompt (5 blocks of 8), then the same prompt again: the second finds its full blocks cached.
    prompt = [7 + (i * 13) % 200 for i in range(40)]
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < 40, cached  # whole blocks, and never the last token (it must be computed for a logit)
    # Chat, streamed with include_usage: the final chunk carries the same field.
    messages = [{"role": "user", "content": "Tell me about the cache, " * 6}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= 8
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_usage_leaves_prompt_details_out_by_default(client):
    resp = client.completions.create(model="tiny", prompt="Hello world", max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens_details is None

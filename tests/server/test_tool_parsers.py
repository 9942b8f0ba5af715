"""Tool calls read out of text: each format's parser, and a stream's deltas joining to the whole reply."""

from __future__ import annotations

import json

import pytest

from jaxserve.server.protocol import ChatCompletionRequest
from jaxserve.server.tool_calls import ToolCallStream, ToolPlan, forced_call_schema
from jaxserve.server.tool_parsers import named_call_parser, parse_call_array, parse_hermes, parse_llama3_json

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'


def _calls(parsed):
    return [(c.name, c.arguments) for c in parsed.calls]


def test_hermes_content_then_calls():
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + '{"name": "now", "arguments": {}}</tool_call>'
    parsed = parse_hermes(text, final=True)
    assert text[: parsed.content_end] == "Let me check.\n"
    assert _calls(parsed) == [("get_weather", WEATHER_ARGS), ("now", "{}")]


def test_hermes_without_a_valid_call_is_all_content():
    assert parse_hermes("no calls here", True).content_end == len("no calls here")
    text = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(text, True).content_end == len(text) and not parse_hermes(text, True).calls
    # Mid-stream, a marker's start is held back; the final text releases it.
    assert parse_hermes("Hi <tool_c", False).content_end == len("Hi ")
    assert parse_hermes("Hi <tool_c", True).content_end == len("Hi <tool_c")
    # A call still being written is not listed; cut off at the end, its JSON decides.
    assert _calls(parse_hermes(f"<tool_call>{WEATHER[:20]}", False)) == []
    assert _calls(parse_hermes(f"<tool_call>{WEATHER}", True)) == [("get_weather", WEATHER_ARGS)]


def test_llama3_json_calls_and_content():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "now", "parameters": {}}'
    assert _calls(parse_llama3_json(text, True)) == [("get_weather", WEATHER_ARGS), ("now", "{}")]
    assert parse_llama3_json(text, True).content_end == 0
    assert parse_llama3_json("The weather is fine.", True).content_end == len("The weather is fine.")
    assert parse_llama3_json("  ", False).content_end == 0  # undecided: a call may still start
    assert parse_llama3_json('{"a": 1}', True).content_end == len('{"a": 1}')  # JSON, but not a call


def test_call_array_lists_each_call_once_it_closes():
    text = '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}}, {"name": "now", "parameters": {}}]'
    assert _calls(parse_call_array(text, True)) == [("get_weather", '{"city": "Pa\\"ris}"}'), ("now", "{}")]
    assert _calls(parse_call_array(text[:66], False)) == [("get_weather", '{"city": "Pa\\"ris}"}')]


def _body(**kw) -> ChatCompletionRequest:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "now"}},
    ]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw})


@pytest.mark.parametrize("parser", ["hermes", "required", "named"])
def test_stream_deltas_join_to_the_whole_reply(parser):
    """Fed a character at a time, the deltas' content and per-call arguments join to what the whole text gives."""
    if parser == "hermes":
        plan, text = ToolPlan.for_request(_body(), "hermes"), f"Checking.<tool_call>{WEATHER}</tool_call>"
    elif parser == "required":
        plan = ToolPlan.for_request(_body(tool_choice="required"), None)
        text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    else:
        plan = ToolPlan.for_request(_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
        text = '{"city": "Paris"}'
    content, calls = ToolCallStream(plan).whole(text)
    stream, streamed, joined = ToolCallStream(plan), "", {}
    for k, ch in enumerate(text):
        piece, made = stream.feed(ch, final=k == len(text) - 1)
        streamed += piece
        for i, call_id, call in made:
            assert (call_id is not None) == (i not in joined)  # the id (and name) only in a call's first delta
            name, args = joined.get(i, (call.name, ""))
            joined[i] = (name, args + call.arguments)
    assert (streamed or None) == content
    assert [joined[i] for i in sorted(joined)] == [(c.name, c.arguments) for _, c in calls]
    assert calls and all(json.loads(c.arguments) is not None for _, c in calls)


def test_plans_and_their_errors():
    assert ToolPlan.for_request(_body(tool_choice="none"), None).parser is None
    assert ToolPlan.for_request(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}]}), None).parser is None
    with pytest.raises(ValueError, match='tool_choice="auto".*--enable-auto-tool-choice'):
        ToolPlan.for_request(_body(), None)
    with pytest.raises(ValueError, match="no function named 'nope'"):
        ToolPlan.for_request(_body(tool_choice={"type": "function", "function": {"name": "nope"}}), None)
    plan = ToolPlan.for_request(_body(), "hermes")
    assert plan.finish_reason(True, "stop") == "tool_calls" and plan.finish_reason(True, "length") == "length"
    named = ToolPlan.for_request(_body(tool_choice={"type": "function", "function": {"name": "now"}}), None)
    assert named.finish_reason(True, "stop") == "stop"  # OpenAI's answer for a named function


def test_forced_schemas():
    body = _body(tool_choice="required", parallel_tool_calls=False)
    schema = forced_call_schema(body.tools, "required", False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"] == {}  # "now" takes no arguments
    assert forced_call_schema(body.tools, "auto", True) is None
    # A forced choice is a constraint: asking for another one too is refused, naming both fields.
    with pytest.raises(ValueError, match="tool_choice=... is invalid together with response_format"):
        _body(tool_choice="required", response_format={"type": "json_object"}).sampling_params(8, None)


def test_named_parser_streams_the_arguments_as_written():
    parse = named_call_parser("f")
    assert _calls(parse("", False)) == [] and _calls(parse('{"a":', False)) == [("f", '{"a":')]


@pytest.mark.parametrize("parser, text", [
    (parse_hermes, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call> and <tool_call>{{bad}}</tool_call><tool_call>{WEATHER}"),
    (parse_hermes, f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER[:30]}"),
    (parse_llama3_json, f'  <|python_tag|>{WEATHER.replace("arguments", "parameters")}; {{"name": "now", "parameters": {{}}}};'),
    (parse_llama3_json, 'Plain {"name": "x"} text'),
    (parse_call_array, '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}}, {"name": "now", "parameters": {}}]'),
])
def test_a_streams_reader_reads_each_prefix_as_the_whole_parser_does(parser, text):
    """A reader remembers what it read (each delta costs its own length); at every prefix, final or not, it
    answers what a fresh parse of that prefix answers."""
    reader = parser.reader()
    for end in range(len(text) + 1):
        got = reader.read(text[:end], final=False)
        want = parser(text[:end], False)
        assert (got.content_end, _calls(got)) == (want.content_end, _calls(want)), end
        final = parser.reader()
        final.read(text[: end // 2], False)
        got, want = final.read(text[:end], True), parser(text[:end], True)
        assert (got.content_end, _calls(got)) == (want.content_end, _calls(want)), end

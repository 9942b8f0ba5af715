"""Structured outputs through the official `openai` client: OpenAI's response_format (json_schema, json_object)
on chat and completions, vLLM's structured_outputs and guided_* fields, and clear 400s for bad constraints."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tiny_models import make_tiny_checkpoint

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    args = EngineArgs(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=256,
        max_num_batched_tokens=32, max_num_seqs=8, block_size=8, compilation_cache_dir="",
    )
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _fits(text: str) -> None:
    value = json.loads(text)
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and set(value) == {"answer", "score"}


def test_chat_json_schema_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=64,
                                          temperature=0.8, seed=1, n=2)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        _fits(choice.message.content)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, max_tokens=64,
                                            temperature=0, stream=True)
    chunks = list(stream)
    _fits("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_the_clients_parse_helper_with_a_pydantic_model(client):
    """openai's chat.completions.parse sends the model's JSON schema (strict) and parses the answer back."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        confident: bool

    resp = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Verdict, max_tokens=64,
                                         temperature=0)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.answer in ("yes", "no")


def test_chat_json_object(client):
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
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
                                     extra_body={"guided_json": SCHEMA})
    _fits(resp.choices[0].text)
    resp = client.completions.create(model="tiny", prompt="Verdict:", max_tokens=64, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "v", "schema": SCHEMA}}})
    _fits(resp.choices[0].text)


@pytest.mark.parametrize("extra,param,match", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "does not compile"),
    ({"structured_outputs": {"regexp": "a"}}, None, "unknown field"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex", "with guided_choice: ask for one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, match):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=extra)
    body = e.value.body
    assert re.search(match, body["message"]), body
    assert body.get("param") == param, body
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None  # the server goes on serving

"""LoRA over HTTP through the official `openai` client: the adapter is chosen by `model`, /v1/models lists
adapters with their parent, unknown models are 404 with an OpenAI error body, load/unload at run time."""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_fixtures import run_cache_dir
from lora_fixtures import make_peft_adapter, peft_greedy
from tiny_models import make_tiny_checkpoint
from transformers import AutoTokenizer

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

PROMPT_IDS = [0, 57, 101, 33, 250, 7, 9, 88]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-api")
    base = make_tiny_checkpoint(root / "llama", "llama")
    a = make_peft_adapter(base, root / "sql", r=8, seed=11)
    b = make_peft_adapter(base, root / "chat", r=16, seed=12, targets=["q_proj", "down_proj"])
    args = EngineArgs(
        model=str(base), served_model_name="tiny", dtype="float32", max_model_len=64, max_num_batched_tokens=32,
        max_num_seqs=8, block_size=8, compilation_cache_dir=run_cache_dir(), precompile="none",
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    with ServerThread(engine, lora_modules=[("sql", a)], allow_runtime_lora_updating=True) as srv:
        yield srv, str(base), a, b


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(client, model):
    resp = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert resp.model == model
    return resp.choices[0].text


def test_models_list_adapters_with_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "sql"}
    assert cards["sql"].model_extra["parent"] == "tiny"


def test_model_field_selects_the_adapter(setup, client):
    _, base, sql, _ = setup
    tok = AutoTokenizer.from_pretrained(base)
    expected = tok.decode(peft_greedy(base, sql, PROMPT_IDS, 6))
    assert _complete(client, "sql") == expected
    assert _complete(client, "tiny") != expected
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
                                          temperature=0)
    assert chat.model == "sql" and chat.usage.completion_tokens <= 3
    resp = client.responses.create(model="sql", input="Hello", max_output_tokens=3, temperature=0)  # the same turn
    assert resp.model == "sql" and resp.output_text == chat.choices[0].message.content


def test_unknown_model_is_404_with_openai_error(client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope")
    assert e.value.body["code"] == "model_not_found" and "nope" in e.value.body["message"]


def test_load_and_unload_at_run_time(setup, client):
    srv, base, _, chat = setup
    r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(base)
    assert _complete(client, "chat") == tok.decode(peft_greedy(base, chat, PROMPT_IDS, 6))
    again = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": chat})
    assert again.status_code == 400
    bad = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "chat")
    assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404


def test_runtime_updating_off_is_404_naming_the_switch(setup):
    srv = setup[0]
    state = srv.app.state.jaxserve
    state.allow_runtime_lora_updating = False
    try:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/x"})
    finally:
        state.allow_runtime_lora_updating = True
    assert r.status_code == 404 and "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]


def test_lora_modules_flag_parses_name_equals_path():
    from jaxserve.server.routes_lora import parse_lora_modules

    assert parse_lora_modules(["sql=/a/b", "chat=/c=d"]) == [("sql", "/a/b"), ("chat", "/c=d")]
    with pytest.raises(ValueError, match="--lora-modules"):
        parse_lora_modules(["just-a-path"])


def test_metrics_list_the_adapters_in_use(setup, client):
    """vLLM's lora_requests_info gauge: max_lora and the running / waiting adapters by name, in its labels."""
    import types

    from jaxserve.llm_engine import _lora_names

    _complete(client, "sql")
    text = httpx.get(setup[0].url + "/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("jaxserve:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line  # nothing runs between requests
    req = lambda name: types.SimpleNamespace(lora_request=name and types.SimpleNamespace(lora_name=name))  # noqa: E731
    sched = types.SimpleNamespace(running=[req("sql"), req(None), req("chat"), req("sql")], waiting=[req("b")])
    assert _lora_names(sched) == {"lora_running": ("chat", "sql"), "lora_waiting": ("b",)}

"""Speculative decoding through the server and the official `openai` client: a draft model (the target itself,
so every greedy proposal is right) with rounds fed by the verify step and verify steps reading their proposals on
the device (on CPU both are off by default: forced on here). Greedy completions, streamed or not, equal the plain
engine's; /metrics counts the drafts."""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_fixtures import run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve import LLM, SamplingParams
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.server.testing import ServerThread

PROMPTS = ["Hello world", "The weather today is", "One two three four five"]
KW = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8, block_size=8,
          compilation_cache_dir=run_cache_dir(), precompile="none")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    spec = {"method": "draft_model", "model": checkpoint_dir, "num_speculative_tokens": 3}
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=checkpoint_dir, served_model_name="tiny", speculative_config=spec, **KW), progress=False
    )
    engine.engine.speculator.fed_rounds = True
    with ServerThread(engine) as srv:
        yield srv, engine.engine.speculator


@pytest.fixture(scope="module")
def plain(checkpoint_dir):
    llm = LLM(checkpoint_dir, **KW, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_completions_equal_the_plain_engine(server, plain):
    srv, spec = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"ignore_eos": True}
    texts = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body=extra)
             .choices[0].text for p in PROMPTS]  # fmt: skip
    assert texts == plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True, extra_body=extra))
    assert streamed == plain[1]
    assert spec.num_fed_rounds > 0 and spec.num_device_fed_steps > 0
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    drafts = [line for line in metrics.splitlines() if line.startswith("jaxserve:spec_decode_num_drafts")]
    assert drafts and float(drafts[0].split()[-1]) > 0

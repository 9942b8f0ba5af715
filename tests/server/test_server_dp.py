"""The HTTP server, unchanged, over a data-parallel engine (DPEngine, two replicas of TP=2 on 4 of the
8 fake CPU devices, each replica in its own process): completions and streamed chat complete, /metrics
sums the replicas' running and waiting requests, and a client that drops its stream gets its request
aborted on whichever replica held it."""

from __future__ import annotations

import asyncio

import httpx
import jax
import openai
import pytest

from dp_probes import set_step_delay
from engine_fixtures import run_cache_dir
from server_probes import metric, wait_idle
from tiny_models import make_tiny_checkpoint

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs
from jaxserve.dp_engine import DPEngine
from jaxserve.server.testing import ServerThread

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    args = EngineArgs(
        model=str(path), served_model_name="tiny", dtype="float32", max_model_len=512,
        max_num_batched_tokens=32, max_num_seqs=4, block_size=8, compilation_cache_dir=run_cache_dir(),
        tensor_parallel_size=2, data_parallel_size=2,
    )
    engine = AsyncLLMEngine.from_engine_args(args, progress=False)
    assert isinstance(engine.engine, DPEngine) and len(engine.engine.replicas) == 2
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_concurrent_completions_and_streamed_chat_complete_on_both_replicas(server, http):
    async def completion(aclient, i):
        resp = await aclient.completions.create(
            model="tiny", prompt=f"Request number {i}", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        )
        return resp.choices[0].finish_reason, resp.usage.completion_tokens

    async def chat(aclient):
        stream = await aclient.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_completion_tokens=8,
            temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
        finish, text = None, ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return finish, text

    async def response(aclient):  # the Responses API, streamed: the same turn as the chat's
        events = await aclient.responses.create(
            model="tiny", input="Hello there", max_output_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        return [e async for e in events][-1].response

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(chat(aclient), response(aclient), *(completion(aclient, i) for i in range(6)))
        finally:
            await aclient.close()

    (finish, text), resp, *completions = asyncio.run(run_all())
    assert finish == "length" and text
    assert resp.status == "incomplete" and resp.output_text == text
    assert completions == [("length", 6)] * 6
    wait_idle(http)
    # The least-loaded router spread the 8 concurrent requests: both replicas generated tokens.
    generated = [r.get_stats().num_generation_tokens for r in server.engine.engine.replicas]
    assert all(n > 0 for n in generated), generated


def test_metrics_report_running_and_waiting_across_replicas(server, http):
    """10 requests on 2 replicas of max_num_seqs=4: 8 run (4 per replica) and 2 wait, and the gauges,
    summed over the replicas, say so while it lasts."""
    body = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True}
    peak = {"jaxserve:num_requests_running": 0.0, "jaxserve:num_requests_waiting": 0.0}

    async def send_all():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(10)))

    async def watch(task):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            while not task.done():
                for line in (await c.get("/metrics")).text.splitlines():
                    name = line.split("{", 1)[0]
                    if name in peak:
                        peak[name] = max(peak[name], float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.05)

    async def main():
        task = asyncio.ensure_future(send_all())
        await watch(task)
        return await task

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 10
    # More running than one replica's max_num_seqs: the gauge sums both replicas.
    assert peak["jaxserve:num_requests_running"] > 4, peak
    assert peak["jaxserve:num_requests_waiting"] >= 1, peak
    wait_idle(http)


@pytest.fixture
def slow_replicas(server):
    """Each replica runs its steps in its own process, so slow them there (a 400-token request must outlive
    a client that leaves early, however fast the machine)."""
    server.engine.engine.collective_rpc(set_step_delay, 0.005)
    yield
    server.engine.engine.collective_rpc(set_step_delay, 0.0)


def test_dropped_stream_is_aborted(server, http, slow_replicas):
    before = metric(http, "jaxserve:request_success_total", finished_reason="abort")
    body = {"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        data = [line for _, line in zip(range(6), resp.iter_lines())]
        assert any(line.startswith("data: ") for line in data)
    # Leaving the block closes the connection mid-stream.
    wait_idle(http)
    assert metric(http, "jaxserve:request_success_total", finished_reason="abort") == before + 1
    assert metric(http, "jaxserve:kv_cache_usage_perc") == 0
    assert not server.engine.engine._placements  # the router forgot it too
    resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1

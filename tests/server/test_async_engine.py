"""AsyncLLMEngine over a fake LLMEngine (no JAX): errors, aborts, crashes, queue limits, and a crash seen over HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from jaxserve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from jaxserve.llm_engine import EngineStats
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.testing import ServerThread


class FakeEngine:
    """LLMEngine's interface: each step gives every request one token (id = 100 + position), text "tN "."""

    def __init__(self, max_num_seqs: int = 8, step_delay: float = 0.002) -> None:
        self.model_config = SimpleNamespace(served_model_name="fake", model="/fake", max_model_len=64)
        self.tokenizer = None
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.crash = threading.Event()
        self.gate = threading.Event()  # steps wait for it, so a test can hold requests "in flight"
        self.gate.set()

    def add_request(self, request_id, prompt, params=None, arrival_time=None):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.requests[request_id] = dict(prompt=list(ids), params=params, out=[[] for _ in range(params.n)])

    def _output(self, rid, req, reason=None) -> RequestOutput:
        limit = req["params"].max_tokens or 16
        comps = []
        for i, toks in enumerate(req["out"]):
            fin = reason or ("length" if len(toks) >= limit else None)
            comps.append(CompletionOutput(i, "".join(f"t{t} " for t in toks), list(toks), finish_reason=fin))
        return RequestOutput(rid, None, req["prompt"], comps, all(c.finish_reason for c in comps))

    def step(self):
        self.gate.wait()
        if self.crash.is_set():
            raise RuntimeError("device on fire")
        time.sleep(self.step_delay)
        outs = []
        for rid in list(self.requests)[: self.max_num_seqs]:
            req = self.requests[rid]
            for toks in req["out"]:
                toks.append(100 + len(toks))
            out = self._output(rid, req)
            if out.finished:
                del self.requests[rid]
            outs.append(out)
        return outs

    def abort_request(self, ids):
        outs = []
        for rid in [ids] if isinstance(ids, str) else ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                outs.append(self._output(rid, req, reason="abort"))
        return outs

    def has_unfinished_requests(self):
        return bool(self.requests)

    def get_stats(self):
        n = len(self.requests)
        running = min(n, self.max_num_seqs)
        return EngineStats(running, n - running, running / 100, 0, 0, 0, 0, 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


@pytest.fixture
def engine():
    eng = AsyncLLMEngine(FakeEngine())
    eng.start()
    yield eng
    eng.engine.gate.set()
    eng.shutdown()


def test_outputs_stream_in_and_end_finished(engine):
    async def main():
        outs = [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=5), "a")]
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [100, 101, 102, 103, 104]
    assert all(not o.finished for o in outs[:-1])


def test_add_errors_come_back_and_others_continue(engine):
    async def main():
        good = await engine.add_request("good", [1], SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("bad", [], SamplingParams())
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("good", [1], SamplingParams())
        return [o async for o in good][-1]

    final = run(main())
    assert final.finished and final.outputs[0].finish_reason == "length"


def test_abort_ends_the_stream_and_frees_the_engine(engine):
    engine.engine.step_delay = 0.02

    async def main():
        stream = await engine.add_request("x", [1], SamplingParams(max_tokens=1000))
        await stream.get()
        engine.abort("x")
        outs = [o async for o in stream]
        return outs[-1]

    last = run(main())
    assert last.outputs[0].finish_reason == "abort"
    assert not engine.engine.has_unfinished_requests()


def test_consumer_leaving_early_aborts(engine):
    async def main():
        agen = engine.generate([1], SamplingParams(max_tokens=1000), "early")
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(200):
            if not engine.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(main())


def test_crash_fails_streams_and_later_adds(engine):
    engine.engine.gate.clear()

    async def main():
        stream = await engine.add_request("victim", [1], SamplingParams(max_tokens=100))
        engine.engine.crash.set()
        engine.engine.gate.set()
        with pytest.raises(EngineDeadError, match="device on fire"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("later", [1], SamplingParams())

    run(main())
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_waiting_queue_limit():
    eng = AsyncLLMEngine(FakeEngine(max_num_seqs=1), max_waiting_requests=2)
    eng.engine.gate.clear()  # hold the first step so nothing finishes
    eng.start()
    try:

        async def main():
            # The engine thread takes new requests between steps; with the step held, adds stay pending.
            adds = [asyncio.ensure_future(eng.add_request(f"r{i}", [1], SamplingParams(max_tokens=2))) for i in range(6)]
            await asyncio.sleep(0.05)
            eng.engine.gate.set()
            results = await asyncio.gather(*adds, return_exceptions=True)
            refused = [r for r in results if isinstance(r, QueueFullError)]
            streams = [r for r in results if not isinstance(r, BaseException)]
            assert len(refused) + len(streams) == 6 and "max-waiting-requests" in str(refused[0])
            return [[o async for o in s][-1].finished for s in streams]

        finished = run(main())
        assert 2 <= len(finished) <= 3 and all(finished)
    finally:
        eng.engine.gate.set()
        eng.shutdown()


def test_shutdown_ends_open_streams():
    eng = AsyncLLMEngine(FakeEngine(step_delay=0.01))
    eng.start()

    async def main():
        stream = await eng.add_request("open", [1], SamplingParams(max_tokens=10_000))
        await stream.get()
        await asyncio.to_thread(eng.shutdown)
        return [o async for o in stream]

    outs = run(main())
    assert outs and outs[-1].outputs[0].finish_reason == "abort"


def test_engine_crash_is_500_and_health_fails():
    eng = AsyncLLMEngine(FakeEngine())
    with ServerThread(eng) as srv, httpx.Client(base_url=srv.url, timeout=20) as http:
        ok = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "t100 t101 t102 "
        assert http.get("/health").status_code == 200
        eng.engine.crash.set()
        crashed = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert crashed.status_code == 500
        assert crashed.json()["error"]["type"] == "server_error"
        health = http.get("/health")
        assert health.status_code == 503 and "device on fire" in health.json()["error"]["message"]
        again = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert again.status_code in (400, 500)  # no tokenizer in the fake: 400 before the engine is asked
        assert http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 500


def test_engine_crash_mid_stream_ends_the_stream_with_an_error_event():
    eng = AsyncLLMEngine(FakeEngine(step_delay=0.05))
    with ServerThread(eng) as srv, httpx.Client(base_url=srv.url, timeout=20) as http:
        body = {"prompt": [1], "max_tokens": 60, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            assert "t100" in next(lines)
            eng.engine.crash.set()
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "device on fire" in rest[-2]

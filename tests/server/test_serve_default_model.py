"""`jaxserve serve` as a user runs it: the embedded default model in a subprocess, then SIGTERM mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from engine_fixtures import run_cache_dir

from jaxserve.server.testing import free_port


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
        "--compilation-cache-dir", run_cache_dir(), "--graceful-shutdown-timeout", "60",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 300s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield proc, url, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_default_model_answers_in_chat(served):
    _, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    resp = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24,
    )
    assert "Paris" in resp.choices[0].message.content


def test_sigterm_finishes_in_flight_streams_then_exits_cleanly(served):
    proc, url, log_path = served
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        # New connections are refused at once, while the stream goes on.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.TransportError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server still accepts connections 10s after SIGTERM")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]

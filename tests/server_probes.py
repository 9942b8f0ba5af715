"""Helpers the server tests share: read /metrics, wait for an idle engine, slow the engine down."""

from __future__ import annotations

import time

import httpx


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """A sample's value from /metrics; 0 for a labelled counter not incremented yet."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    assert labels, f"{name} not in /metrics"
    return 0.0


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(http, "jaxserve:num_requests_running") == 0 and metric(http, "jaxserve:num_requests_waiting") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("requests still running or waiting after the client went away")


def slow_steps(monkeypatch, engine, seconds: float = 0.005) -> None:
    """Make each step of ``engine`` (what an AsyncLLMEngine drives) take at least ``seconds``, so that a
    400-token request surely outlives a client that leaves early, however fast the machine."""
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(seconds) or step())

"""Prometheus metrics at GET /metrics, named as vLLM's under the ``jaxserve:`` prefix.

Gauges are read from the engine's latest stats when scraped; token counters and latency histograms
are fed by the engine thread through the EngineObserver hooks. Each app has its own registry, so
several servers in one process (tests) never clash.
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.async_engine import AsyncLLMEngine, EngineObserver
from jaxserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineGauges(Collector):
    """Gauges computed at scrape time from the engine's latest stats (no polling thread needed)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_loras: Optional[int] = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_loras = max_loras  # None: LoRA is off

    def collect(self):
        stats = self.engine.get_stats()
        label = ["model_name"]
        values = [
            ("jaxserve:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("jaxserve:num_requests_waiting", "Requests waiting to be scheduled.", self.engine.num_waiting),
            ("jaxserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", stats.kv_cache_usage),
            ("jaxserve:num_preemptions", "Requests preempted so far (KV cache full).", stats.num_preemptions),
        ]
        for name, doc, value in values:
            g = GaugeMetricFamily(name, doc, labels=label)
            g.add_metric([self.model_name], float(value))
            yield g
        if stats.spec_accepted_per_pos:  # speculative decoding is on
            yield from _spec_decode_metrics(stats, self.model_name)
        if self.max_loras is not None:  # LoRA is on
            yield _lora_requests_info(stats, self.max_loras)


def _lora_requests_info(stats, max_loras: int) -> GaugeMetricFamily:
    """vLLM's ``lora_requests_info``: the adapters in use in its labels (comma-separated names), its value the
    time of the reading, so that a dashboard shows the latest set."""
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    g = GaugeMetricFamily("jaxserve:lora_requests_info", "Running and waiting LoRA adapters.", labels=labels)
    g.add_metric([str(max_loras), ",".join(stats.lora_running), ",".join(stats.lora_waiting)], time.time())
    return g


class _CacheConfigInfo(Collector):
    """The KV cache as built, as vLLM's ``cache_config_info``: a constant 1 whose labels carry the numbers (blocks
    per replica, block size, cache dtype), so that an fp8 cache's larger block count shows on a dashboard."""

    def __init__(self, info: dict, model_name: str) -> None:
        self.labels = {
            "model_name": model_name,
            "num_gpu_blocks": str(info["num_kv_blocks"]),
            "block_size": str(info["block_size"]),
            "cache_dtype": str(info.get("kv_cache_dtype", "auto")),
            "data_parallel_size": str(info.get("data_parallel_size", 1)),
        }

    def collect(self):
        g = GaugeMetricFamily("jaxserve:cache_config_info", "Information of the KV cache as built.", labels=list(self.labels))
        g.add_metric(list(self.labels.values()), 1.0)
        yield g


def _spec_decode_metrics(stats, model_name: str):
    """vLLM's spec-decode counters; acceptance rate = accepted / draft tokens, mean acceptance length =
    1 + accepted / drafts (per position: accepted_per_pos / drafts)."""
    for name, doc, value in (
        ("jaxserve:spec_decode_num_drafts", "Sequences verified with proposals.", stats.spec_num_drafts),
        ("jaxserve:spec_decode_num_draft_tokens", "Proposed tokens verified.", stats.spec_num_draft_tokens),
        ("jaxserve:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", stats.spec_num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], float(value))
        yield c
    c = CounterMetricFamily(
        "jaxserve:spec_decode_num_accepted_tokens_per_pos", "Accepted proposals, by position in the draft.",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(stats.spec_accepted_per_pos):
        c.add_metric([model_name, str(pos)], float(value))
    yield c


class ServerMetrics(EngineObserver):
    """The registry of one server, and the observer the engine thread reports tokens to."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        kw = dict(labelnames=labels, registry=self.registry)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of requests that started.", **kw)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens.", **kw)
        self.requests_finished = Counter(
            "jaxserve:request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "jaxserve:time_to_first_token_seconds", "Time from arrival to the first token.", buckets=_TTFT_BUCKETS, **kw
        )
        self.itl = Histogram(
            "jaxserve:inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
            buckets=_ITL_BUCKETS, **kw,
        )
        self.e2e = Histogram(
            "jaxserve:e2e_request_latency_seconds", "Time from arrival to finish.", buckets=_E2E_BUCKETS, **kw
        )
        # Bound children, so the hot path skips the label lookup.
        self._prompt = self.prompt_tokens.labels(model_name)
        self._gen = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)

    def attach(self, engine: AsyncLLMEngine) -> None:
        info_fn = getattr(engine.engine, "info", None)  # test doubles of the engine may have none
        info = info_fn() if info_fn is not None else {}
        lora = info.get("lora") or {}
        self.registry.register(_EngineGauges(engine, self.model_name, lora.get("max_loras")))
        if "num_kv_blocks" in info:  # generate engines (a pooling engine keeps no KV cache)
            self.registry.register(_CacheConfigInfo(info, self.model_name))

    # EngineObserver hooks (engine thread).
    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt.inc(num_prompt_tokens)

    def on_new_tokens(self, num_tokens: int, inter_token_s: Optional[float]) -> None:
        self._gen.inc(num_tokens)
        if inter_token_s is not None:
            for _ in range(num_tokens):
                self._itl.observe(inter_token_s)

    def on_finished(self, e2e_s: float, output: RequestOutput) -> None:
        self._e2e.observe(e2e_s)
        for comp in output.outputs:
            self.requests_finished.labels(self.model_name, comp.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE)

"""`jaxserve bench serve`: a load generator for any OpenAI-compatible server (ours, vLLM, ...).

Requests stream over SSE so that every token's arrival is timed; the report has vLLM's `bench serve`
layout (throughput, TTFT, TPOT, ITL). Random prompts are cut to exact token lengths with the server's
own /tokenize and /detokenize (jaxserve and vLLM have them) or a local --tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Optional

import numpy as np

# Common English words: random prompts read like text, so every tokenizer splits them sensibly.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but be have one "
    "all were when we there can an which their said if do will each about how up out them then she many "
    "some so these would other into has more two like him see time could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right "
    "look think also around another came come work three word must because does part even place well such"
).split()


@dataclasses.dataclass
class BenchPrompt:
    text: str
    prompt_len: int  # tokens as we counted them (the server's usage count wins when it reports one)
    output_len: int


@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last byte
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between token-bearing chunks
    token_times: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, tokens in chunk)


def add_parser(bench_sub) -> None:
    p = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    p.add_argument("--base-url", "--base_url", dest="base_url", default="http://127.0.0.1:8000",
                   help="server root, without /v1 (default: http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--endpoint", choices=["completions", "chat", "responses"], default="completions")
    p.add_argument("--api-key", "--api_key", dest="api_key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", "--dataset_name", dest="dataset_name", choices=["random", "json"], default="random")
    p.add_argument("--dataset-path", "--dataset_path", dest="dataset_path", default=None,
                   help='JSON list of {"prompt": str, "output_len": int} or ShareGPT conversations')
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=100)
    p.add_argument("--random-input-len", "--random_input_len", dest="random_input_len", type=int, default=1024)
    p.add_argument("--random-output-len", "--random_output_len", dest="random_output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", "--random_range_ratio", dest="random_range_ratio", type=float, default=0.0,
                   help="lengths vary uniformly in [len*(1-r), len*(1+r)] (default: exact)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer (HF dir) instead of the server's /tokenize")
    p.add_argument("--request-rate", "--request_rate", dest="request_rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", "--max_concurrency", dest="max_concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS so outputs have the asked length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", "--result_json", dest="result_json", default=None, help="write the results here")
    p.set_defaults(func=run)


# ---------------------------------------------------------------- prompts


class _Tokenizer:
    """Tokenize/detokenize locally (--tokenizer) or through the server's /tokenize and /detokenize."""

    def __init__(self, client, model: str, local_path: Optional[str]) -> None:
        self.client, self.model, self.local = client, model, None
        if local_path:
            from transformers import AutoTokenizer

            self.local = AutoTokenizer.from_pretrained(local_path)

    async def encode(self, text: str) -> Optional[list[int]]:
        if self.local is not None:
            return self.local.encode(text, add_special_tokens=False)
        r = await self.client.post("/tokenize", json={"model": self.model, "prompt": text, "add_special_tokens": False})
        return r.json()["tokens"] if r.status_code == 200 else None

    async def decode(self, ids: list[int]) -> str:
        if self.local is not None:
            return self.local.decode(ids)
        r = await self.client.post("/detokenize", json={"model": self.model, "tokens": ids})
        r.raise_for_status()
        return r.json()["prompt"]


def _lengths(rng, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


async def random_prompts(ns, tok: _Tokenizer) -> list[BenchPrompt]:
    rng = np.random.default_rng(ns.seed)
    ins = _lengths(rng, ns.random_input_len, ns.random_range_ratio, ns.num_prompts)
    outs = _lengths(rng, ns.random_output_len, ns.random_range_ratio, ns.num_prompts)
    prompts = []
    for n_in, n_out in zip(ins, outs):
        text = " ".join(rng.choice(_WORDS, size=n_in * 2))
        ids = await tok.encode(text)
        if ids is None:  # no tokenizer anywhere: a word is roughly a token for these words
            if not prompts:
                print("bench serve: the server has no /tokenize and no --tokenizer was given; "
                      "prompt lengths are approximate (one word ~ one token)", file=sys.stderr)
            prompts.append(BenchPrompt(" ".join(text.split()[:n_in]), n_in, n_out))
            continue
        prompts.append(BenchPrompt(await tok.decode(ids[:n_in]), n_in, n_out))
    return prompts


async def dataset_prompts(ns, tok: _Tokenizer) -> list[BenchPrompt]:
    with open(ns.dataset_path) as f:
        items = json.load(f)
    prompts = []
    for it in items[: ns.num_prompts]:
        if "conversations" in it:  # ShareGPT: the first human turn; the reply's length as output length
            turns = it["conversations"]
            if len(turns) < 2:
                continue
            text, reply = turns[0]["value"], turns[1]["value"]
            reply_ids = await tok.encode(reply)
            out_len = len(reply_ids) if reply_ids is not None else len(reply.split())
        else:
            text, out_len = it["prompt"], int(it.get("output_len", ns.random_output_len))
        ids = await tok.encode(text)
        prompts.append(BenchPrompt(text, len(ids) if ids is not None else len(text.split()), max(1, out_len)))
    return prompts


# ---------------------------------------------------------------- requests


def _payload(ns, model: str, p: BenchPrompt, max_tokens: int, stream: bool = True) -> tuple[str, dict]:
    body = {
        "model": model, "max_tokens": max_tokens, "temperature": ns.temperature, "stream": stream,
        "stream_options": {"include_usage": True},
    }
    if ns.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and jaxserve's extra; other servers ignore it
    if ns.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p.text}]}
    if ns.endpoint == "responses":  # OpenAI's Responses API: its own names, no stream_options (usage comes last)
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "stream_options")}
        return "/v1/responses", {**body, "max_output_tokens": max_tokens, "input": p.text, "store": False}
    return "/v1/completions", {**body, "prompt": p.text}


def _chunk_text(chunk: dict, endpoint: str) -> str:
    if endpoint == "responses":  # an event: text (answer or reasoning) deltas count, the rest is bookkeeping
        return chunk.get("delta") or "" if chunk.get("type", "").endswith(("output_text.delta", "reasoning_text.delta")) else ""
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    if endpoint == "chat":  # a reasoning model's first tokens arrive as reasoning (--reasoning-parser): they count
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning") or delta.get("reasoning_content") or "")
    return c.get("text") or ""


async def send_one(client, ns, model: str, p: BenchPrompt) -> RequestResult:
    path, body = _payload(ns, model, p, p.output_len)
    res = RequestResult(prompt_len=p.prompt_len, start=time.perf_counter())
    last = res.start
    chunks = 0
    try:
        async with client.stream("POST", path, json=body, timeout=ns.timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    res.prompt_len = chunk["usage"].get("prompt_tokens", res.prompt_len)
                elif (chunk.get("response") or {}).get("usage"):  # the Responses API's last event
                    res.output_tokens = chunk["response"]["usage"].get("output_tokens", 0)
                    res.prompt_len = chunk["response"]["usage"].get("input_tokens", res.prompt_len)
                if not _chunk_text(chunk, ns.endpoint):
                    continue
                if chunks == 0:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                res.token_times.append((now, 1))
        res.latency = time.perf_counter() - res.start
        if not res.output_tokens:  # no usage from the server: count chunks (one token each, as usual)
            res.output_tokens = chunks
        res.ok = chunks > 0
        if not res.ok:
            res.error = "no tokens in the response"
    except Exception as e:  # noqa: BLE001 - one failed request must not end the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(n: int, rate: float, seed: int):
    """Yield request indices at Poisson arrival times (all at once for rate=inf)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def benchmark(ns) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=ns.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=ns.timeout) as client:
        model = ns.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        tok = _Tokenizer(client, model, ns.tokenizer)
        prompts = await (dataset_prompts(ns, tok) if ns.dataset_name == "json" else random_prompts(ns, tok))
        if not prompts:
            raise ValueError("no prompts to send (check --num-prompts / --dataset-path)")
        print(f"bench serve: {len(prompts)} prompts -> {ns.base_url} ({model}, {ns.endpoint}); test request...")
        test = await send_one(client, ns, model, dataclasses.replace(prompts[0], output_len=min(4, prompts[0].output_len)))
        if not test.ok:
            raise RuntimeError(f"the test request failed: {test.error}")
        sem = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None

        async def limited(p):
            if sem is None:
                return await send_one(client, ns, model, p)
            async with sem:
                return await send_one(client, ns, model, p)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), ns.request_rate, ns.seed):
            tasks.append(asyncio.create_task(limited(prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(ns, model, results, duration)


# ---------------------------------------------------------------- report


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(ns, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    # Peak output tokens/s over 1-second windows, and most requests in flight at once.
    times = [t for r in ok for t, n in r.token_times for _ in range(n)]
    peak_tps = float(np.bincount(((np.asarray(times) - min(times)) // 1.0).astype(int)).max()) if times else 0.0
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    peak_conc = max(np.cumsum([e for _, e in events]).tolist() or [0])
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": ns.base_url, "model": model, "endpoint": ns.endpoint,
        "num_prompts": len(results),
        # Strict JSON has no Infinity.
        "request_rate": ns.request_rate if np.isfinite(ns.request_rate) else "inf",
        "max_concurrency": ns.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "peak_output_throughput": peak_tps, "peak_concurrent_requests": int(peak_conc),
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2el_ms": _stats([r.latency for r in ok]),
        # Each request's output tokens over its own end-to-end time: the rate one user sees.
        "request_output_throughput": _stats([r.output_tokens / r.latency for r in ok if r.latency > 0], scale=1.0),
        "client": {"python": platform.python_version(), "host": platform.node()},
    }


def format_report(m: dict) -> str:
    line = "{:<40} {:<10}".format
    num = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    rows = ["{:=^50}".format(" Serving Benchmark Result "), line("Successful requests:", m["completed"]),
            line("Failed requests:", m["failed"])]
    if m["max_concurrency"]:
        rows.append(line("Maximum request concurrency:", m["max_concurrency"]))
    rows += [
        line("Request rate configured (RPS):", num(float(m["request_rate"]))),
        line("Benchmark duration (s):", num(m["duration_s"])),
        line("Total input tokens:", m["total_input_tokens"]),
        line("Total generated tokens:", m["total_output_tokens"]),
        line("Request throughput (req/s):", num(m["request_throughput"])),
        line("Output token throughput (tok/s):", num(m["output_throughput"])),
        line("Peak output token throughput (tok/s):", num(m["peak_output_throughput"])),
        line("Peak concurrent requests:", num(float(m["peak_concurrent_requests"]))),
        line("Total Token throughput (tok/s):", num(m["total_token_throughput"])),
    ]
    for key, title, name in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL")):
        rows.append("{:-^50}".format(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append(line(f"{label} {name} (ms):", num(m[key][stat])))
    rows.append("=" * 50)
    return "\n".join(rows)


def run(ns: argparse.Namespace) -> int:
    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts={ns.num_prompts} is invalid: must be >= 1")
    if ns.request_rate <= 0:
        raise ValueError(f"--request-rate={ns.request_rate} is invalid: must be > 0 (inf sends all at once)")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={ns.max_concurrency} is invalid: must be >= 1")
    if ns.dataset_name == "json" and not ns.dataset_path:
        raise ValueError("--dataset-name json needs --dataset-path FILE")
    metrics = asyncio.run(benchmark(ns))
    print(format_report(metrics))
    for err in metrics["errors"]:
        print(f"error: {err}", file=sys.stderr)
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump(metrics, f, indent=1)
    return 0 if metrics["completed"] else 1

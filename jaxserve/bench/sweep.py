"""`jaxserve bench sweep`: the same offline and serving workloads under several (tensor, data) parallel layouts.

    jaxserve bench sweep --tp 4,2,1 --dp 1,2,4 --model DIR --output-json sweep.json --output-png sweep.png

Every configuration that fits (tp * dp <= devices present, tp divides the model's head counts) runs in
its own fresh Python process: each one starts with all device memory free and nothing compiled, and
this parent never initialises a JAX backend (on a GPU it would otherwise hold the memory the children
need). Each child builds the engine, warms it with two requests, then times one ``LLM.generate`` over
a seeded random workload, identical for every configuration, and reports throughput and per-request
latency (from each RequestOutput's arrival / first-token / finish times).

Then (unless --no-serve) the serving phase: the same child puts the OpenAI HTTP server on that engine
(uvicorn on 127.0.0.1, a free port; the engine is already compiled, so nothing is rebuilt) and drives it
with `jaxserve bench serve`'s load generator: --serve-num-prompts seeded random text prompts of the
same lengths, streamed, at most --serve-concurrency in flight. It records TTFT, inter-token latency and
output tok/s as a client sees them, so DP's router and the server's per-step overheads show up too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Optional


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("sweep", help="offline throughput and latency for each TP x DP layout")
    p.add_argument("--tp", default="1", help="comma-separated tensor_parallel_size values (default: 1)")
    p.add_argument("--dp", default="1", help="comma-separated data_parallel_size values (default: 1)")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=64)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=64)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.5)
    p.add_argument("--serve-concurrency", "--serve_concurrency", dest="serve_concurrency", type=int, default=8,
                   help="serving phase: most requests in flight at once (default: 8)")
    p.add_argument("--serve-num-prompts", "--serve_num_prompts", dest="serve_num_prompts", type=int, default=32,
                   help="serving phase: requests sent (default: 32)")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="skip the serving phase (offline only; also needed with --skip-tokenizer-init)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per configuration (both phases)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default="sweep.json")
    p.add_argument("--output-png", "--output_png", dest="output_png", default="sweep.png",
                   help="plot of throughput and latency per configuration (needs matplotlib)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{flag}={text!r} is invalid: give positive integers separated by commas, e.g. 4,2,1")
    return values


def _probe_devices() -> dict:
    """Device count and kind, asked of a child process so this one never claims the devices."""
    code = "import jax, json; d = jax.devices(); print(json.dumps({'count': len(d), 'kind': d[0].device_kind, 'platform': d[0].platform, 'jax': jax.__version__}))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _skip_reason(tp: int, dp: int, num_devices: int, heads: Optional[tuple[int, int]]) -> Optional[str]:
    if tp * dp > num_devices:
        return f"needs {tp * dp} devices, {num_devices} present"
    if heads is not None and (heads[0] % tp or heads[1] % tp):
        return f"tp={tp} does not divide {heads[0]} heads / {heads[1]} kv heads"
    return None


def _model_heads(args) -> Optional[tuple[int, int]]:
    from jaxserve.model_loader import read_text_config, resolve_model_path

    path, _ = resolve_model_path(args.model, args.load_format)
    cfg = read_text_config(path)
    return cfg.num_attention_heads, cfg.num_key_value_heads


def run(ns: argparse.Namespace) -> int:
    from jaxserve.cli import engine_args_from

    tps, dps = _int_list("tp", ns.tp), _int_list("dp", ns.dp)
    base = dataclasses.asdict(engine_args_from(ns))
    dev = _probe_devices()
    heads = _model_heads(engine_args_from(ns))
    workload = dict(num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                    range_ratio=ns.range_ratio)
    if ns.serve:
        workload["serve"] = _serve_workload(ns, base)
    rows = []
    for tp in tps:
        for dp in dps:
            reason = _skip_reason(tp, dp, dev["count"], heads)
            if reason:
                print(f"sweep: tp={tp} dp={dp}: skipped ({reason})")
                rows.append({"tp": tp, "dp": dp, "skipped": reason})
                continue
            print(f"sweep: tp={tp} dp={dp}: running...", flush=True)
            args = {**base, "tensor_parallel_size": tp, "data_parallel_size": dp}
            row = {"tp": tp, "dp": dp, **_run_child(args, workload, ns.timeout)}
            rows.append(row)
            _print_row(row)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev["kind"], "platform": dev["platform"],
        "num_devices": dev["count"], "jax": dev["jax"], "python": platform.python_version(),
        "command": " ".join(sys.argv), "workload": workload, "engine_args": base, "configs": rows,
    }
    with open(ns.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(rows))
    if ns.serve:
        print(format_serving_table(rows))
    print(f"sweep: wrote {ns.output_json}")
    if ns.output_png and plot(result, ns.output_png):
        print(f"sweep: wrote {ns.output_png}")
    return 0


def _serve_workload(ns: argparse.Namespace, engine_args: dict) -> dict:
    """The serving phase's settings, checked here so that a bad flag fails before any child starts."""
    if ns.serve_concurrency < 1:
        raise ValueError(f"--serve-concurrency={ns.serve_concurrency} is invalid: must be >= 1")
    if ns.serve_num_prompts < 1:
        raise ValueError(f"--serve-num-prompts={ns.serve_num_prompts} is invalid: must be >= 1 (or pass --no-serve)")
    if engine_args.get("skip_tokenizer_init"):
        raise ValueError("--skip-tokenizer-init leaves the server no tokenizer for its text prompts: "
                         "give the model a tokenizer, or pass --no-serve")
    return dict(num_prompts=ns.serve_num_prompts, concurrency=ns.serve_concurrency, input_len=ns.input_len,
                output_len=ns.output_len, range_ratio=ns.range_ratio)


def _print_row(row: dict) -> None:
    where = f"sweep: tp={row['tp']} dp={row['dp']}"
    if "error" in row:
        print(f"{where}: failed: {row['error']}")
        return
    print(f"{where}: {row['output_tokens_per_s']:.1f} output tok/s, "
          f"latency mean {row['latency_s']['mean']:.2f}s p99 {row['latency_s']['p99']:.2f}s")
    serve = row.get("serve")
    if serve and "error" in serve:
        print(f"{where}: serving failed: {serve['error']}")
    elif serve:
        print(f"{where}: serving {serve['output_tokens_per_s']:.1f} output tok/s, TTFT mean "
              f"{serve['ttft_ms']['mean']:.0f} ms, ITL mean {serve['itl_ms']['mean']:.1f} ms")


def _run_child(args: dict, workload: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        req, res = os.path.join(d, "config.json"), os.path.join(d, "result.json")
        with open(req, "w") as f:
            json.dump({"engine_args": args, "workload": workload}, f)
        cmd = [sys.executable, "-m", "jaxserve.bench.sweep", req, res]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired as e:
            # Say how far the child got (start-up compiles, warm-up or the timed run): a row that never
            # finished building its engine needs a longer --timeout, not a faster engine.
            phase = _last_phase(e.stdout, e.stderr)
            return {"error": f"timed out after {timeout:.0f}s" + (f" ({phase})" if phase else "")}
        if proc.returncode != 0 or not os.path.exists(res):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit code {proc.returncode}: {' | '.join(tail)}"}
        with open(res) as f:
            return json.load(f)


PHASE_PREFIX = "bench child: "  # the child's progress lines on stderr, quoted when it is killed


def _last_phase(stdout, stderr) -> str:
    """The child's last `bench child:` line, from whatever output a killed child left."""
    text = "\n".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (stdout, stderr) if x)
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.startswith(PHASE_PREFIX)]
    return lines[-1][len(PHASE_PREFIX):] if lines else ""


# ---------------------------------------------------------------- one configuration (child process)


def _phase(text: str) -> None:
    print(PHASE_PREFIX + text, file=sys.stderr, flush=True)


def _percentiles(values: list[float]) -> dict:
    import numpy as np

    arr = np.asarray(values or [0.0])
    return {"mean": float(arr.mean()), "p50": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def measure(engine_args: dict, workload: dict) -> tuple[dict, object]:
    """Build one engine and time the workload; runs in the child. Returns the results and the engine."""
    from jaxserve.bench.workload import random_workload
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    _phase("building the engine (loading weights, compiling step shapes)")
    llm = LLM(**engine_args, use_tqdm_on_load=False)
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.text_config.vocab_size
    work = random_workload(workload["num_prompts"], workload["input_len"], workload["output_len"],
                           workload["range_ratio"], vocab, seed=0, token_range=(min(100, vocab // 2), min(vocab, 32000)))
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]
    _phase(f"engine ready after {startup_s:.0f} s; warming up")
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # host-side warm-up; step shapes are precompiled
    _phase(f"warm after {time.perf_counter() - t0:.0f} s; timing the workload")
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(w.prompt_token_ids) for w in work)
    m = [o.metrics for o in outs]
    tpot = [(x["finish_time"] - x["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
            for o, x in zip(outs, m) if len(o.outputs[0].token_ids) > 1]
    return {
        "elapsed_s": elapsed, "startup_s": startup_s,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        # All requests arrive at once: latency includes queueing behind the others, as in vLLM's offline runs.
        "latency_s": _percentiles([x["finish_time"] - x["arrival_time"] for x in m]),
        "ttft_s": _percentiles([x["first_token_time"] - x["arrival_time"] for x in m]),
        "tpot_s": _percentiles(tpot),
        "num_kv_blocks": engine.info()["num_kv_blocks"],
    }, engine


def measure_serving(engine, serve: dict) -> dict:
    """Serve ``engine`` (LLMEngine or DPEngine) over loopback HTTP and load it with `bench serve`; runs in the child."""
    import asyncio

    from jaxserve.async_engine import AsyncLLMEngine
    from jaxserve.bench import serve as bench_serve
    from jaxserve.server.testing import ServerThread

    with ServerThread(AsyncLLMEngine(engine)) as srv:
        m = asyncio.run(bench_serve.benchmark(_serve_namespace(srv.url, serve)))
    if not m["completed"]:
        raise RuntimeError(f"no serving request completed: {m['errors']}")
    pct = lambda d: {"mean": d["mean"], "p50": d["median"], "p99": d["p99"]}  # noqa: E731 - offline's key names
    return {
        "num_prompts": m["num_prompts"], "concurrency": serve["concurrency"], "completed": m["completed"],
        "failed": m["failed"], "errors": m["errors"], "duration_s": m["duration_s"],
        "requests_per_s": m["request_throughput"], "output_tokens_per_s": m["output_throughput"],
        "peak_concurrent_requests": m["peak_concurrent_requests"],
        "ttft_ms": pct(m["ttft_ms"]), "itl_ms": pct(m["itl_ms"]), "tpot_ms": pct(m["tpot_ms"]),
        "e2el_ms": pct(m["e2el_ms"]),
        # Each request's own output tok/s (its tokens over its end-to-end time): the rate one user sees.
        "request_output_tokens_per_s": pct(m["request_output_throughput"]),
    }


def _serve_namespace(base_url: str, serve: dict) -> argparse.Namespace:
    """`bench serve`'s flags, parsed by its own parser so that every other setting keeps its default."""
    from jaxserve.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    return parser.parse_args([
        "serve", "--base-url", base_url, "--num-prompts", str(serve["num_prompts"]),
        "--max-concurrency", str(serve["concurrency"]), "--random-input-len", str(serve["input_len"]),
        "--random-output-len", str(serve["output_len"]), "--random-range-ratio", str(serve["range_ratio"]),
        "--seed", "0",
    ])


# ---------------------------------------------------------------- report


def format_table(rows: list[dict]) -> str:
    head = "| TP | DP | devices | output tok/s | req/s | latency mean / p99 (s) | TTFT mean (s) | TPOT mean (ms) |"
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "output_tokens_per_s" not in r:
            lines.append(f"| {r['tp']} | {r['dp']} | {r['tp'] * r['dp']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        lines.append(
            f"| {r['tp']} | {r['dp']} | {r['tp'] * r['dp']} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
            f"| {r['latency_s']['mean']:.2f} / {r['latency_s']['p99']:.2f} | {r['ttft_s']['mean']:.2f} "
            f"| {1000 * r['tpot_s']['mean']:.1f} |"
        )
    return "\n".join(lines)


def format_serving_table(rows: list[dict]) -> str:
    """The serving phase, one row per layout: client-side throughput and latency (ms)."""
    head = ("| TP | DP | concurrency | output tok/s | req/s | per-request tok/s mean / p50 / p99 "
            "| TTFT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | failed |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    three = lambda d, f: " / ".join(f"{d[k]:{f}}" for k in ("mean", "p50", "p99"))  # noqa: E731
    for r in rows:
        s = r.get("serve")
        if not s or "error" in s:
            why = (s or {}).get("error") or r.get("skipped") or r.get("error") or "not run"
            lines.append(f"| {r['tp']} | {r['dp']} | | {why} | | | | | |")
            continue
        lines.append(
            f"| {r['tp']} | {r['dp']} | {s['concurrency']} | {s['output_tokens_per_s']:.1f} | {s['requests_per_s']:.2f} "
            f"| {three(s['request_output_tokens_per_s'], '.1f')} | {three(s['ttft_ms'], '.0f')} "
            f"| {three(s['itl_ms'], '.1f')} | {s['failed']} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    """Throughput and latency bars per configuration; False (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("sweep: matplotlib is not installed (pip install matplotlib): no plot written")
        return False
    rows = [r for r in result["configs"] if "output_tokens_per_s" in r]
    if not rows:
        return False
    served = any("output_tokens_per_s" in r.get("serve", {}) for r in rows)
    panels = 3 if served else 2
    fig, axes = plt.subplots(1, panels, figsize=(min(18, max(4 * panels, 0.6 * panels * len(rows) + 4)), 4.2))
    _plot_throughput(axes[0], rows, served)
    _plot_offline_latency(axes[1], rows)
    if served:
        _plot_serving_latency(axes[2], rows)
    labels = [f"tp{r['tp']}\ndp{r['dp']}" for r in rows]
    for ax in axes:
        ax.set_xticks(range(len(rows)), labels)
    fig.suptitle(f"jaxserve sweep: {result['device']} x{result['num_devices']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _bars(ax, rows: list[dict], series: list[tuple[str, list[float]]]) -> None:
    """Grouped bars, one group per configuration; a missing value (a failed serving phase) is 0."""
    w = 0.8 / len(series)
    for k, (name, values) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * w for i in range(len(rows))], values, w, label=name)
    ax.legend(fontsize=7)


def _serve_value(r: dict, key: str, stat: str | None = None) -> float:
    s = r.get("serve", {})
    if key not in s:
        return 0.0
    return s[key] if stat is None else s[key][stat]


def _plot_throughput(ax, rows: list[dict], served: bool) -> None:
    series = [("offline", [r["output_tokens_per_s"] for r in rows])]
    if served:
        series.append(("serving", [_serve_value(r, "output_tokens_per_s") for r in rows]))
    _bars(ax, rows, series)
    ax.set_title("output throughput (tok/s)")


def _plot_offline_latency(ax, rows: list[dict]) -> None:
    _bars(ax, rows, [("mean latency", [r["latency_s"]["mean"] for r in rows]),
                     ("mean TTFT", [r["ttft_s"]["mean"] for r in rows]),
                     ("p99 latency", [r["latency_s"]["p99"] for r in rows])])
    ax.set_title("offline latency (s)")


def _plot_serving_latency(ax, rows: list[dict]) -> None:
    # TTFT (hundreds of ms) and ITL (tens) share one axis: a log scale keeps both readable.
    _bars(ax, rows, [(f"{name} {stat}", [_serve_value(r, key, stat) for r in rows])
                     for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")) for stat in ("mean", "p99")])
    ax.set_yscale("log")
    ax.set_title(f"serving latency (ms), concurrency {rows[0].get('serve', {}).get('concurrency', '?')}")


def _child_main(req_path: str, res_path: str) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    with open(req_path) as f:
        req = json.load(f)
    result, engine = measure(req["engine_args"], req["workload"])
    serve = req["workload"].get("serve")
    if serve:
        # A serving failure must not lose the offline numbers: record it next to them.
        try:
            result["serve"] = measure_serving(engine, serve)
        except Exception as e:  # noqa: BLE001
            logging.exception("serving phase failed")
            result["serve"] = {"error": f"{type(e).__name__}: {e}"}
    with open(res_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:3]))

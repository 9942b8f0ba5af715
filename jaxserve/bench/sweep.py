"""`jaxserve bench sweep`: the same offline workload under several (tensor, data) parallel layouts.

    jaxserve bench sweep --tp 4,2,1 --dp 1,2,4 --model DIR --output-json sweep.json --output-png sweep.png

Every configuration that fits (tp * dp <= devices present, tp divides the model's head counts) runs in
its own fresh Python process: each one starts with all device memory free and nothing compiled, and
this parent never initialises a JAX backend (on a GPU it would otherwise hold the memory the children
need). Each child builds the engine, warms it with two requests, then times one ``LLM.generate`` over
a seeded random workload, identical for every configuration, and reports throughput and per-request
latency (from each RequestOutput's arrival / first-token / finish times).
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
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per configuration")
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
            if "error" in row:
                print(f"sweep: tp={tp} dp={dp}: failed: {row['error']}")
            else:
                print(f"sweep: tp={tp} dp={dp}: {row['output_tokens_per_s']:.1f} output tok/s, "
                      f"latency mean {row['latency_s']['mean']:.2f}s p99 {row['latency_s']['p99']:.2f}s")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev["kind"], "platform": dev["platform"],
        "num_devices": dev["count"], "jax": dev["jax"], "python": platform.python_version(),
        "command": " ".join(sys.argv), "workload": workload, "engine_args": base, "configs": rows,
    }
    with open(ns.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(format_table(rows))
    print(f"sweep: wrote {ns.output_json}")
    if ns.output_png and plot(result, ns.output_png):
        print(f"sweep: wrote {ns.output_png}")
    return 0


def _run_child(args: dict, workload: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        req, res = os.path.join(d, "config.json"), os.path.join(d, "result.json")
        with open(req, "w") as f:
            json.dump({"engine_args": args, "workload": workload}, f)
        cmd = [sys.executable, "-m", "jaxserve.bench.sweep", req, res]
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f}s"}
        if proc.returncode != 0 or not os.path.exists(res):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"exit code {proc.returncode}: {' | '.join(tail)}"}
        with open(res) as f:
            return json.load(f)


# ---------------------------------------------------------------- one configuration (child process)


def _percentiles(values: list[float]) -> dict:
    import numpy as np

    arr = np.asarray(values or [0.0])
    return {"mean": float(arr.mean()), "p50": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def measure(engine_args: dict, workload: dict) -> dict:
    """Build one engine and time the workload; runs in the child."""
    from jaxserve.bench.workload import random_workload
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_args, use_tqdm_on_load=False)
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    vocab = engine.text_config.vocab_size
    work = random_workload(workload["num_prompts"], workload["input_len"], workload["output_len"],
                           workload["range_ratio"], vocab, seed=0, token_range=(min(100, vocab // 2), min(vocab, 32000)))
    prompts = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w.output_len) for w in work]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # host-side warm-up; step shapes are precompiled
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
    }


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
    labels = [f"tp{r['tp']}\ndp{r['dp']}" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4))
    ax1.bar(x, [r["output_tokens_per_s"] for r in rows], color="tab:blue")
    ax1.set_title("output throughput (tok/s)")
    w = 0.27
    for k, (key, name) in enumerate((("latency_s", "mean latency"), ("ttft_s", "mean TTFT"))):
        ax2.bar([i + (k - 0.5) * w for i in x], [r[key]["mean"] for r in rows], w, label=name)
    ax2.bar([i + 1.5 * w for i in x], [r["latency_s"]["p99"] for r in rows], w, label="p99 latency")
    ax2.set_title("latency (s)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels)
    fig.suptitle(f"jaxserve sweep: {result['device']} x{result['num_devices']}, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _child_main(req_path: str, res_path: str) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    with open(req_path) as f:
        req = json.load(f)
    result = measure(req["engine_args"], req["workload"])
    with open(res_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:3]))

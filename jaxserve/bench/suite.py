"""`jaxserve bench suite`: issue 11's goals 1-3 and 6 in one command, one JSON and one PNG.

    jaxserve bench suite --model DIR --load-format dummy --output-dir OUT [--parts offline,serve,ablation]

Parts, each an ordinary bench command run in a child process (printed before it runs, so any part can be
rerun alone), in this order:
- offline (goals 1 and 2): `bench throughput --roofline --single-stream [--compare-hf]`: one engine measures
  the single stream (--single-stream-* lengths) and the offline workload (--num-prompts x --input-len ->
  --output-len), each against its roofline and HF transformers.
- serve (goal 3): `jaxserve serve` in a child process, then `bench serve`'s load generator from this
  process at each --serve-concurrency (--serve-prompts-per-slot x concurrency streamed requests,
  --input-len -> --output-len tokens; the model needs a tokenizer: model_shapes writes one).
- ablation (goal 6): `bench ablation` on the offline workload.
This process never initialises JAX, so the children have the device to themselves. Results land in
OUT/offline.json, OUT/serve_c{N}.json, OUT/ablation/, and the summary in OUT/suite.json and OUT/suite.png.

Split over several calls (a device call has a time limit): run each call with the same --output-dir and
engine flags; a part not run in this call is summarised from the files an earlier call left there, and
the ablation takes its HF and default rows from offline.json when that measured the same workload and flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time

from jaxserve.bench.latency import add_single_stream_args

PARTS = ("offline", "serve", "ablation")

# Issue 11's targets on one H200, Llama-3-8B shape (meaningless elsewhere; reported next to the measurement).
TARGETS = {
    "single_stream_tokens_per_s": (">=", 215.0),
    "offline_output_tokens_per_s": (">=", 10000.0),
    "serve_c64_output_tokens_per_s": (">=", 6000.0),
    "serve_c64_tpot_mean_ms": ("<=", 10.0),
    "serve_c64_ttft_p99_ms": ("<=", 1000.0),
}


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("suite", help="issue 11's benchmarks (single stream, offline, serving, ablation)")
    p.add_argument("--parts", default="offline,serve", help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default="bench-suite")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=256)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=512)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=256)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.0)
    add_single_stream_args(p, prefix="single-stream")
    p.add_argument("--serve-concurrency", "--serve_concurrency", dest="serve_concurrency", default="1,8,64")
    p.add_argument("--serve-prompts-per-slot", "--serve_prompts_per_slot", dest="serve_prompts_per_slot", type=int,
                   default=4, help="serving: requests sent = this x concurrency (default 4: 256 at concurrency 64)")
    p.add_argument("--no-compare-hf", dest="compare_hf", action="store_false", help="skip HF transformers")
    p.add_argument("--hf-batch-size", "--hf_batch_size", dest="hf_batch_size", type=int, default=64)
    p.add_argument("--eager-scale", "--eager_scale", dest="eager_scale", type=float, default=0.125)
    p.add_argument("--quick", action="store_true", help="small roofline measurements (smoke runs, CPU tests)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per part")
    add_engine_args(p)
    p.set_defaults(func=run)


def _parts(text: str) -> list[str]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or any(x not in PARTS for x in parts):
        raise ValueError(f"--parts={text!r} is invalid: choose from {','.join(PARTS)}")
    return [x for x in PARTS if x in parts]


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--serve-concurrency={text!r} is invalid: give positive integers separated by commas, e.g. 1,8,64")
    return values


def run(ns: argparse.Namespace) -> int:
    from jaxserve.bench.launch import engine_flags
    from jaxserve.cli import engine_args_from

    # `timeout` or a job limit sends SIGTERM: unwind so that the child running now is killed (subprocess.run
    # does that on any exception) and the server child is stopped, instead of leaving them on the device.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parts = _parts(ns.parts)
    concurrencies = _concurrencies(ns.serve_concurrency) if "serve" in parts else []
    if ns.serve_prompts_per_slot < 1:
        raise ValueError(f"--serve-prompts-per-slot={ns.serve_prompts_per_slot} is invalid: must be >= 1")
    args = engine_args_from(ns)
    if "serve" in parts and args.skip_tokenizer_init:
        raise ValueError("the serve part sends text prompts: drop --skip-tokenizer-init (model_shapes writes a "
                         "tokenizer next to the config), or leave serve out of --parts")
    os.makedirs(ns.output_dir, exist_ok=True)
    flags = engine_flags(args)
    workload = ["--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len),
                "--output-len", str(ns.output_len), "--range-ratio", str(ns.range_ratio)]
    hf = ["--compare-hf", "--hf-batch-size", str(ns.hf_batch_size)] if ns.compare_hf else []
    quick = ["--quick"] if ns.quick else []
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "python": platform.python_version(),
               "workload": dict(num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                                range_ratio=ns.range_ratio), "parts": {}}
    if "offline" in parts:
        out = os.path.join(ns.output_dir, "offline.json")
        cmd = ["bench", "throughput", *flags, *workload, "--roofline", "--single-stream",
               "--single-stream-input-len", str(ns.single_stream_input_len),
               "--single-stream-output-len", str(ns.single_stream_output_len),
               "--single-stream-repeats", str(ns.single_stream_repeats), *hf, *quick, "--output-json", out]
        summary["parts"]["offline"] = _run_part(cmd, out, ns.timeout)
    if "serve" in parts:
        summary["parts"]["serve"] = _serve_part(ns, args, concurrencies)
    if "ablation" in parts:
        out_dir = os.path.join(ns.output_dir, "ablation")
        rows = "hf,fp32,no-chunked-prefill,eager,default" if ns.compare_hf else "fp32,no-chunked-prefill,eager,default"
        cmd = ["bench", "ablation", *flags, *workload, "--rows", rows, "--hf-batch-size", str(ns.hf_batch_size),
               "--eager-scale", str(ns.eager_scale), "--timeout", str(ns.timeout), "--output-dir", out_dir]
        offline = os.path.join(ns.output_dir, "offline.json")
        if _reusable_offline(offline, summary["workload"], dataclasses.asdict(args), ns.compare_hf):
            # The offline part measured the HF and default rows already (same workload and flags, checked
            # again by `bench ablation --reuse`): two processes fewer, minutes on an 8B model.
            cmd += ["--reuse", offline]
        summary["parts"]["ablation"] = _run_part(cmd, os.path.join(out_dir, "ablation.json"), 6 * ns.timeout)
    for name in PARTS:  # parts run by an earlier call with the same --output-dir complete the summary
        if name not in summary["parts"] and (earlier := _earlier_result(ns.output_dir, name)) is not None:
            summary["parts"][name] = {**earlier, "from_earlier_run": True}
    summary["goals"] = goals(summary["parts"])
    out_json = os.path.join(ns.output_dir, "suite.json")
    with open(out_json, "w") as f:
        json.dump(summary, f, indent=1)
    print(format_goals(summary["goals"]))
    print(f"suite: wrote {out_json}")
    out_png = os.path.join(ns.output_dir, "suite.png")
    if plot(summary, out_png):
        print(f"suite: wrote {out_png}")
    failed = [name for name, part in summary["parts"].items() if "error" in part]
    return 1 if failed else 0


def _run_part(cli_args: list[str], result_path: str, timeout: float) -> dict:
    """Run `jaxserve <cli_args>` in a child process (output shown as it comes); its JSON, or an error."""
    print("suite: running: jaxserve " + " ".join(cli_args), flush=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", *cli_args], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0 or not os.path.exists(result_path):
        return {"error": f"`jaxserve {' '.join(cli_args[:2])}` exited with code {proc.returncode}"}
    with open(result_path) as f:
        return json.load(f)


def _reusable_offline(path: str, workload: dict, engine_args: dict, need_hf: bool) -> bool:
    if not os.path.exists(path):
        return False
    with open(path) as f:
        res = json.load(f)
    return res.get("workload") == workload and res.get("engine_args") == engine_args and (not need_hf or "hf" in res)


def _earlier_result(out_dir: str, part: str) -> dict | None:
    """A part's results as an earlier `bench suite` call left them in ``out_dir`` (None if absent)."""
    if part == "serve":
        runs = []
        for name in sorted(os.listdir(out_dir)):
            if name.startswith("serve_c") and name.endswith(".json"):
                with open(os.path.join(out_dir, name)) as f:
                    runs.append(json.load(f))
        return {"runs": sorted(runs, key=lambda r: r["concurrency"])} if runs else None
    path = os.path.join(out_dir, "offline.json" if part == "offline" else "ablation/ablation.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_part(ns, args, concurrencies: list[int]) -> dict:
    from jaxserve.bench import serve as bench_serve
    from jaxserve.bench.launch import ServerProcess
    from jaxserve.bench.sweep import _serve_namespace

    log = os.path.join(ns.output_dir, "server.log")
    print(f"suite: starting `jaxserve serve` (log: {log})...", flush=True)
    runs = []
    try:
        with ServerProcess(args, _free_port(), log, startup_timeout=ns.timeout) as srv:
            for c in concurrencies:
                load = dict(num_prompts=c * ns.serve_prompts_per_slot, concurrency=c, input_len=ns.input_len,
                            output_len=ns.output_len, range_ratio=ns.range_ratio)
                m = asyncio.run(bench_serve.benchmark(_serve_namespace(srv.url, load)))
                m["concurrency"] = c
                with open(os.path.join(ns.output_dir, f"serve_c{c}.json"), "w") as f:
                    json.dump(m, f, indent=1)
                print(bench_serve.format_report(m), flush=True)
                runs.append(m)
    except Exception as e:  # noqa: BLE001 - keep what was measured before the failure
        return {"error": f"{type(e).__name__}: {e}", "runs": runs}
    return {"startup_s": srv.startup_s, "runs": runs}


# ---------------------------------------------------------------- summary


def goals(parts: dict) -> list[dict]:
    """Each goal's measurement (None when its part did not run or failed) next to issue 11's target."""
    off, serve = parts.get("offline", {}), parts.get("serve", {})
    c64 = next((r for r in serve.get("runs", []) if r["concurrency"] == 64), None)
    measured = {
        "single_stream_tokens_per_s": off.get("single_stream", {}).get("tokens_per_s"),
        "offline_output_tokens_per_s": off.get("output_tokens_per_s"),
        "serve_c64_output_tokens_per_s": c64 and c64["output_throughput"],
        "serve_c64_tpot_mean_ms": c64 and c64["tpot_ms"]["mean"],
        "serve_c64_ttft_p99_ms": c64 and c64["ttft_ms"]["p99"],
    }
    rows = []
    for key, (op, target) in TARGETS.items():
        value = measured[key]
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        rows.append({"metric": key, "measured": value, "target": f"{op} {target:g}", "met": met})
    return rows


def format_goals(rows: list[dict]) -> str:
    lines = ["| metric | measured | issue 11 target (8B, H200) | met |", "|---|---:|---:|---|"]
    for r in rows:
        value = "not run" if r["measured"] is None else f"{r['measured']:.1f}"
        met = "–" if r["met"] is None else ("yes" if r["met"] else "no")
        lines.append(f"| {r['metric']} | {value} | {r['target']} | {met} |")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> bool:
    """One panel per part that ran: single stream and offline (jaxserve, HF, roofline), serving per
    concurrency, ablation speed-ups."""
    from jaxserve.bench.plotting import pyplot

    plt = pyplot()
    parts = {k: v for k, v in summary["parts"].items() if "error" not in v}
    panels = []
    off = parts.get("offline")
    if off:
        if "single_stream" in off:
            ss = off["single_stream"]
            panels.append((f"single stream tok/s: {100 * ss['roofline_fraction']:.0f}% of roofline",
                           _engine_bars(ss, "tokens_per_s", "tokens_per_s")))
        panels.append((f"offline output tok/s: {100 * off['roofline_fraction']:.0f}% of roofline",
                       _engine_bars(off, "output_tokens_per_s", "output_tokens_per_s")))
    if parts.get("serve", {}).get("runs"):
        panels.append(("serving", parts["serve"]["runs"]))
    if parts.get("ablation", {}).get("rows"):
        panels.append(("ablation", parts["ablation"]))
    if plt is None or not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (title, data) in zip(axes[0], panels):
        if title == "serving":
            _plot_serving(ax, data)
        elif title == "ablation":
            _plot_ablation(ax, data)
        else:
            names, values = zip(*data)
            bars = ax.bar(names, values, color=["#3b75af", "#999999", "#dddddd"][: len(names)])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
            ax.set_title(title, fontsize=9)
    device = (off or {}).get("device", "")
    fig.suptitle(f"jaxserve bench suite {device} {summary['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _engine_bars(res: dict, key: str, roof_key: str) -> list[tuple[str, float]]:
    bars = [("jaxserve", res[key])]
    if "hf" in res:
        bars.append(("HF", res["hf"][key] if key in res["hf"] else res["hf"]["output_tokens_per_s"]))
    if "roofline" in res:
        bars.append(("roofline", res["roofline"][roof_key]))
    return bars


def _plot_serving(ax, runs: list[dict]) -> None:
    xs = range(len(runs))
    bars = ax.bar(xs, [r["output_throughput"] for r in runs], color="#3b75af", label="output tok/s")
    ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(xs, [f"c={r['concurrency']}" for r in runs])
    ax.set_title("serving: output tok/s (bars), TPOT / TTFT p99 ms (lines)", fontsize=8)
    twin = ax.twinx()
    twin.plot(xs, [r["tpot_ms"]["mean"] for r in runs], "o-", color="#d62728", label="TPOT mean (ms)")
    twin.plot(xs, [r["ttft_ms"]["p99"] for r in runs], "s--", color="#2ca02c", label="TTFT p99 (ms)")
    twin.set_yscale("log")
    twin.legend(fontsize=7, loc="upper left")


def _plot_ablation(ax, result: dict) -> None:
    rows = [r for r in result["rows"] if "output_tokens_per_s" in r]
    speedup = all("speedup_vs_hf" in r for r in rows)
    bars = ax.bar([r["row"] for r in rows], [r["speedup_vs_hf"] if speedup else r["output_tokens_per_s"] for r in rows],
                  color=["#999999" if r["row"] == "hf" else "#3b75af" for r in rows])
    ax.bar_label(bars, fmt="%.2f" if speedup else "%.0f", fontsize=7)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.set_title("ablation: speed-up over HF" if speedup else "ablation: output tok/s", fontsize=9)

"""`jaxserve bench ablation`: what each engine feature buys, as speed-up over HF transformers on one workload.

    jaxserve bench ablation --model DIR --load-format dummy --num-prompts 256 --input-len 512 --output-len 256 \
        --range-ratio 0 --output-dir OUT

Rows (--rows picks a subset, in this order): HF transformers `generate` (static batches) in the shipped
dtype; HF in float32 (`hf-fp32`, not run unless asked: on the CPU the first row is float32 already); jaxserve in
float32; jaxserve without chunked prefill; jaxserve with enforce_eager (no whole-step jit); jaxserve as
shipped (dtype auto: bf16 on accelerators). Every row's speed-up is against the first HF row, and the
jaxserve float32 row's also against HF in float32 (`speedup_vs_hf_same_dtype`), so fp32 compares like with like. Every row runs in a fresh Python process of its own (HF through
jaxserve.bench.hf_generate, jaxserve through `bench sweep`'s child), one after another, so each starts with
all device memory free and no row's compiled code or caches help another. Each jaxserve child warms up with
two requests, then times one `LLM.generate` over the same seeded workload (EOS ignored).

enforce_eager dispatches every op from Python, so its row would take many minutes: it runs the workload
scaled by --eager-scale (same number of prompts, so the same batch width; input and output lengths scaled,
so the same mix of prefill and decode steps) and says so in its row. Its tok/s compares with the others
as long as a step's cost does not depend much on context length, which holds where dispatch dominates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

ROWS = ("hf", "hf-fp32", "fp32", "no-chunked-prefill", "eager", "default")
DEFAULT_ROWS = ("hf", "fp32", "no-chunked-prefill", "eager", "default")

# What each row changes, for the table (the docs explain the measured differences).
NOTES = {
    "hf": "HF transformers generate, static batches, padded to the batch's longest prompt and output",
    "hf-fp32": "HF transformers generate in float32 (the like-for-like baseline of the fp32 row)",
    "fp32": "jaxserve, float32 weights and activations (twice the bytes of bf16; full-precision matmuls)",
    "no-chunked-prefill": "jaxserve, a prompt must fit one step: no mixing of prefill chunks with decodes",
    "eager": "jaxserve, enforce_eager: no whole-step jit, every op dispatched from Python",
    "default": "jaxserve as shipped (dtype auto, chunked prefill, jitted step)",
}


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("ablation", help="speed-up over HF with engine features turned off one at a time")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=256)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=512)
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=256)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.0)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated subset of {','.join(ROWS)} (default: {','.join(DEFAULT_ROWS)})")
    p.add_argument("--hf-batch-size", "--hf_batch_size", dest="hf_batch_size", type=int, default=64)
    p.add_argument("--eager-scale", "--eager_scale", dest="eager_scale", type=float, default=0.125,
                   help="the eager row's input and output lengths are scaled by this (1: the same workload)")
    p.add_argument("--reuse", default=None, metavar="JSON",
                   help="take rows from this earlier result of the same workload and engine flags instead of running "
                        "them again: a `bench throughput --compare-hf` JSON (its hf and default rows) or an earlier "
                        "ablation.json (every row it finished; lets one table span several runs)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per row")
    p.add_argument("--output-dir", "--output_dir", dest="output_dir", default="ablation",
                   help="writes ablation.json and ablation.png here")
    add_engine_args(p)
    p.set_defaults(func=run)


def parse_rows(text: str) -> list[str]:
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if not rows or bad:
        raise ValueError(f"--rows={text!r} is invalid: choose from {','.join(ROWS)}")
    return [r for r in ROWS if r in rows]


def row_settings(name: str, base: dict, workload: dict, eager_scale: float) -> tuple[dict, dict]:
    """(engine args, workload) of one jaxserve row."""
    if name == "fp32":
        return {**base, "dtype": "float32"}, workload
    if name == "no-chunked-prefill":
        # Without chunking the step budget must hold a whole max_model_len prompt; the engine raises it
        # itself unless a smaller budget was given explicitly, so raise that one here.
        budget, max_len = base.get("max_num_batched_tokens"), base.get("max_model_len")
        if budget is not None:
            budget = max(budget, max_len) if max_len else None
        return {**base, "enable_chunked_prefill": False, "max_num_batched_tokens": budget}, workload
    if name == "eager":
        scaled = {**workload, "input_len": max(1, round(workload["input_len"] * eager_scale)),
                  "output_len": max(2, round(workload["output_len"] * eager_scale))}
        return {**base, "enforce_eager": True}, scaled
    return base, workload


def run(ns: argparse.Namespace) -> int:
    from jaxserve.bench import sweep
    from jaxserve.bench.hf_generate import run_in_subprocess
    from jaxserve.bench.workload import random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.model_loader import read_text_config, resolve_model_path

    rows_wanted = parse_rows(ns.rows)
    if not 0 < ns.eager_scale <= 1:
        raise ValueError(f"--eager-scale={ns.eager_scale} is invalid: must be in (0, 1]")
    args = engine_args_from(ns)
    base = dataclasses.asdict(args)
    dev = sweep._probe_devices()  # a child asks: this process must not claim the device the rows need
    dtype = args.dtype if args.dtype != "auto" else ("float32" if dev["platform"] == "cpu" else "bfloat16")
    workload = dict(num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                    range_ratio=ns.range_ratio)
    os.makedirs(ns.output_dir, exist_ok=True)
    reused = _reusable(ns.reuse, workload, base, ns.eager_scale) if ns.reuse else {}
    out_json = os.path.join(ns.output_dir, "ablation.json")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": dev["kind"], "platform": dev["platform"],
        "jax": dev["jax"], "python": platform.python_version(), "command": " ".join(sys.argv),
        "workload": workload, "eager_scale": ns.eager_scale, "engine_args": base, "rows": [],
    }
    rows = result["rows"]
    for name in rows_wanted:
        if name in reused:
            print(f"ablation: {name}: taken from {ns.reuse}")
            rows.append({"row": name, "note": NOTES[name], "workload": workload, **reused[name], "reused_from": ns.reuse})
            _print_row(rows[-1])
            continue
        print(f"ablation: {name}: running...", flush=True)
        if name in ("hf", "hf-fp32"):
            row_dtype = dtype if name == "hf" else "float32"
            path, _ = resolve_model_path(args.model, args.load_format)
            vocab = read_text_config(path).vocab_size
            # The same requests as the jaxserve children draw (sweep.measure's seed and token range).
            work = random_workload(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio, vocab, seed=0,
                                   token_range=(min(100, vocab // 2), min(vocab, 32000)))
            try:
                row = {"output_tokens_per_s": run_in_subprocess(path, work, ns.hf_batch_size, row_dtype)["output_tokens_per_s"],
                       "dtype": row_dtype, "batch_size": ns.hf_batch_size}
            except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                row = {"error": f"{type(e).__name__}: {e}"}
            row["workload"] = workload
        else:
            engine_args, row_work = row_settings(name, base, workload, ns.eager_scale)
            row = {**sweep._run_child(engine_args, row_work, ns.timeout), "workload": row_work,
                   "dtype": engine_args["dtype"] if engine_args["dtype"] != "auto" else dtype}
        rows.append({"row": name, "note": NOTES[name], **row})
        _print_row(rows[-1])
        # Written after every row: a run cut short by its time limit keeps the rows it finished (--reuse takes them).
        _write(result, out_json)
    add_speedups(rows)
    _write(result, out_json)
    print(format_table(rows))
    print(f"ablation: wrote {out_json}")
    out_png = os.path.join(ns.output_dir, "ablation.png")
    if plot(result, out_png):
        print(f"ablation: wrote {out_png}")
    return 0


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_hf against the first HF row; speedup_vs_hf_same_dtype against the HF row of the row's dtype."""
    done = [r for r in rows if "output_tokens_per_s" in r]
    hf = next((r for r in done if r["row"] == "hf"), None)
    hf_by_dtype = {}
    for r in done:
        if r["row"] in ("hf", "hf-fp32"):
            hf_by_dtype.setdefault(r.get("dtype"), r)
    for r in done:
        if hf:
            r["speedup_vs_hf"] = r["output_tokens_per_s"] / hf["output_tokens_per_s"]
        same = hf_by_dtype.get(r.get("dtype"))
        if same and r["row"] not in ("hf", "hf-fp32"):
            r["speedup_vs_hf_same_dtype"] = r["output_tokens_per_s"] / same["output_tokens_per_s"]


def _write(result: dict, path: str) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def _reusable(path: str, workload: dict, engine_args: dict, eager_scale: float) -> dict:
    """Finished rows of an earlier result, after checking it measured the same thing.

    An ablation.json gives every row it finished; a `bench throughput` JSON gives its default and hf rows.
    """
    with open(path) as f:
        res = json.load(f)
    if res.get("workload") != workload:
        raise ValueError(f"--reuse {path}: its workload {res.get('workload')} is not this one {workload}")
    if res.get("engine_args") not in (None, engine_args):
        raise ValueError(f"--reuse {path}: it ran with other engine flags than these")
    if "rows" in res:
        if res.get("eager_scale") != eager_scale and any(r["row"] == "eager" for r in res["rows"]):
            raise ValueError(f"--reuse {path}: its eager row ran at --eager-scale {res.get('eager_scale')}, "
                             f"not {eager_scale}; pass --eager-scale {res.get('eager_scale')} or run the row again")
        keep = ("output_tokens_per_s", "dtype", "batch_size", "workload")
        return {r["row"]: {k: r[k] for k in keep if k in r} for r in res["rows"] if "output_tokens_per_s" in r}
    rows = {"default": {"output_tokens_per_s": res["output_tokens_per_s"], "dtype": res["engine_info"]["dtype"]}}
    if "hf" in res:
        rows["hf"] = {"output_tokens_per_s": res["hf"]["output_tokens_per_s"], "dtype": res["hf"]["dtype"],
                      "batch_size": res["hf"]["batch_size"]}
    return rows


def _print_row(r: dict) -> None:
    if "error" in r:
        print(f"ablation: {r['row']}: failed: {r['error']}")
    else:
        print(f"ablation: {r['row']}: {r['output_tokens_per_s']:.1f} output tok/s")


def _workload_text(w: dict) -> str:
    return f"{w['num_prompts']} x {w['input_len']} -> {w['output_len']}"


def format_table(rows: list[dict]) -> str:
    lines = ["| row | output tok/s | speed-up vs HF | vs HF, same dtype | workload | what it changes |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        tps = f"{r['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in r else f"failed: {r.get('error')}"
        speedup = f"{r['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in r else "–"
        same = f"{r['speedup_vs_hf_same_dtype']:.2f}x" if "speedup_vs_hf_same_dtype" in r else "–"
        lines.append(f"| {r['row']} | {tps} | {speedup} | {same} | {_workload_text(r['workload'])} | {r['note']} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    """Bars of speed-up over HF (or of tok/s when HF is missing), each labelled with its tok/s."""
    from jaxserve.bench.plotting import pyplot

    plt = pyplot()
    rows = result["rows"]  # a failed row keeps its place, as an empty bar that says why
    done = [r for r in rows if "output_tokens_per_s" in r]
    if plt is None or not done:
        return False
    use_speedup = all("speedup_vs_hf" in r for r in done)
    values = [r.get("speedup_vs_hf" if use_speedup else "output_tokens_per_s", 0) for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows) + 2), 4))
    bars = ax.bar(range(len(rows)), values, color=["#999999" if r["row"].startswith("hf") else "#3b75af" for r in rows])
    for bar, r in zip(bars, rows):
        if "output_tokens_per_s" not in r:
            label = "failed: " + str(r.get("error", "no result"))[:28]
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", fontsize=6, rotation=90)
            continue
        label = f"{r['output_tokens_per_s']:.0f} tok/s" + ("*" if r["workload"] != result["workload"] else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["row"] for r in rows], fontsize=8)
    ax.set_ylabel("speed-up over HF transformers" if use_speedup else "output tok/s")
    w = result["workload"]
    title = f"{result['device']}: {_workload_text(w)} tokens"
    if any(r["workload"] != w for r in rows):
        title += f"\n* eager row on a workload scaled by {result['eager_scale']}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

"""`jaxserve bench vl`: vision-language serving throughput (Qwen2-VL) beside HF transformers' generate.

    python -m jaxserve.bench.model_shapes qwen2-vl-7b /tmp/qwen2-vl-7b
    jaxserve bench vl --model /tmp/qwen2-vl-7b --load-format dummy --output-json vl.json

Workload (seeded, the same in every row): --num-prompts requests, each one random --image-size square image
between two halves of --input-len random text tokens, --output-len new tokens, EOS ignored. Rows (--rows picks
a subset, in this order): HF generate in float32 and in bfloat16 (static batches, the fastest of
--hf-batch-sizes); jaxserve in float32, in bfloat16, bfloat16 without chunked prefill, and bfloat16 with
enforce_eager. Each row runs in a fresh Python process, one after another, so each starts with all device
memory free. Every jitted jaxserve row first runs the whole workload once on other images (so every step
shape and the vision step's bucket it reaches are compiled, with any --precompile), then times one
LLM.generate over the workload; the eager row warms up on the prompts with 8 new tokens, and its timed run
makes --output-len x --eager-scale new tokens a request (1.0 by default: the same workload). Image preprocessing, the
vision tower and the decoder are all inside the timed region, as they are in HF's rows. A row's JSON says
how many shapes still compiled inside its timed region (``lazy_compiles_timed``; 0 means a clean timing).

Rows can be run in separate calls (``--rows``) and put together with ``--include`` earlier outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

ROWS = ("hf-fp32", "hf-bf16", "fp32", "bf16", "bf16-no-chunked-prefill", "bf16-eager")
NOTES = {
    "hf-fp32": "HF transformers generate, float32, static batches",
    "hf-bf16": "HF transformers generate, bfloat16, static batches",
    "fp32": "jaxserve, float32",
    "bf16": "jaxserve, bfloat16 (as shipped on GPUs)",
    "bf16-no-chunked-prefill": "jaxserve, bfloat16, a prompt must fit one step",
    "bf16-eager": "jaxserve, bfloat16, enforce_eager: no jit, every op dispatched from Python",
}


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("vl", help="vision-language throughput (Qwen2-VL): jaxserve rows beside HF generate")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=128)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=64, help="text tokens a prompt")
    p.add_argument("--image-size", "--image_size", dest="image_size", type=int, default=448, help="pixels a side")
    p.add_argument("--output-len", "--output_len", dest="output_len", type=int, default=128)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--hf-batch-sizes", "--hf_batch_sizes", dest="hf_batch_sizes", default="32,64,128",
                   help="HF rows time each of these static batch sizes and keep the fastest")
    p.add_argument("--eager-scale", "--eager_scale", dest="eager_scale", type=float, default=1.0,
                   help="the bf16-eager row makes output-len x this many new tokens a request (every op of every "
                        "layer is dispatched from Python, so the full workload can take minutes); the table says so")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per row")
    p.add_argument("--include", nargs="*", default=[], metavar="JSON",
                   help="rows of earlier `bench vl` outputs (same workload) to add to this table, not run again")
    p.add_argument("--output-json", "--output_json", dest="output_json", default="bench_vl.json")
    add_engine_args(p)
    p.set_defaults(func=run)


def make_workload(vl_config, num_prompts: int, input_len: int, image_size: int, output_len: int, seed: int = 0):
    """[(prompt ids with one image placeholder, PIL image)], seeded: text, then the image, then text."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    specials = [i for i in (vl_config.image_token_id, vl_config.vision_start_token_id, vl_config.vision_end_token_id)
                if i is not None]  # fmt: skip
    vocab = vl_config.text.vocab_size
    lo, hi = min(100, vocab // 8), min(vocab, 32000, *specials)  # plain words, clear of special tokens
    before = input_len // 2
    out = []
    for _ in range(num_prompts):
        text = rng.integers(lo, hi, size=input_len).tolist()
        ids = text[:before] + [vl_config.vision_start_token_id, vl_config.image_token_id, vl_config.vision_end_token_id]
        pixels = rng.integers(0, 256, size=(image_size, image_size, 3), dtype=np.uint8)
        out.append((ids + text[before:], Image.fromarray(pixels)))
    return out


def row_settings(name: str, base: dict) -> dict:
    """The engine args of one jaxserve row."""
    args = {**base, "dtype": "float32" if name == "fp32" else "bfloat16"}
    if name == "bf16-no-chunked-prefill":
        budget, max_len = base.get("max_num_batched_tokens"), base.get("max_model_len")
        budget = max(budget, max_len) if budget and max_len else None  # a whole prompt must fit one step
        args.update(enable_chunked_prefill=False, max_num_batched_tokens=budget)
    if name == "bf16-eager":
        args["enforce_eager"] = True
    return args


def run(ns: argparse.Namespace) -> int:
    from jaxserve.cli import engine_args_from

    if not 0 < ns.eager_scale <= 1:
        raise ValueError(f"--eager-scale={ns.eager_scale} is invalid: give a fraction in (0, 1], e.g. 0.125")
    rows_wanted = [r.strip() for r in ns.rows.split(",") if r.strip()]
    bad = [r for r in rows_wanted if r not in ROWS]
    if (not rows_wanted and not ns.include) or bad:
        raise ValueError(f"--rows={ns.rows!r} is invalid: choose from {','.join(ROWS)}")
    from jaxserve.model_loader import read_text_config, resolve_model_path

    args = engine_args_from(ns)
    path, _ = resolve_model_path(args.model, args.load_format)
    if args.max_model_len is None:  # the workload's prompts are ~330 tokens: no need for the model's 32k
        args = dataclasses.replace(args, max_model_len=min(4096, read_text_config(path).max_position_embeddings))
    base = dataclasses.asdict(args)
    workload = dict(num_prompts=ns.num_prompts, input_len=ns.input_len, image_size=ns.image_size,
                    output_len=ns.output_len)  # fmt: skip
    batch_sizes = [int(b) for b in ns.hf_batch_sizes.split(",") if b.strip()]
    rows = _included(ns.include, workload)
    for name in (r for r in ROWS if r in rows_wanted):
        print(f"bench vl: {name}: running...", flush=True)
        if name.startswith("hf-"):
            spec = {"model": path, "dtype": "float32" if name == "hf-fp32" else "bfloat16", "batch_sizes": batch_sizes,
                    "workload": workload}  # fmt: skip
            row = _child("jaxserve.bench.hf_vl_generate", spec, ns.timeout)
        else:
            work = dict(workload)
            if name == "bf16-eager":
                work["output_len"] = max(1, round(ns.output_len * ns.eager_scale))
            spec = {"engine_args": row_settings(name, base), "workload": work}
            row = _child("jaxserve.bench.vl", spec, ns.timeout)
            if work != workload:
                row["output_len"] = work["output_len"]
        rows.append({"row": name, "note": NOTES[name], **row})
        _print_row(rows[-1])
    _speedups(rows)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "workload": workload,
              "engine_args": base, "rows": rows}  # fmt: skip
    print(format_table(rows))
    with open(ns.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"bench vl: wrote {ns.output_json}")
    return 0


def _included(paths: list[str], workload: dict) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        if res.get("workload") != workload:
            raise ValueError(f"--include {path}: its workload {res.get('workload')} is not this one {workload}")
        rows += [{**r, "included_from": path} for r in res["rows"]]
    return rows


def _speedups(rows: list[dict]) -> None:
    """Each row's speed-up over HF in the same dtype, and over HF's fastest row."""
    hf = {r["dtype"]: r["output_tokens_per_s"] for r in rows
          if r["row"].startswith("hf-") and "output_tokens_per_s" in r}  # fmt: skip
    best = max(hf.values(), default=None)
    for r in rows:
        if "output_tokens_per_s" not in r:
            continue
        if r.get("dtype") in hf:
            r["speedup_vs_hf_same_dtype"] = r["output_tokens_per_s"] / hf[r["dtype"]]
        if best:
            r["speedup_vs_best_hf"] = r["output_tokens_per_s"] / best


def _child(module: str, spec: dict, timeout: float) -> dict:
    """Run ``python -m module SPEC RESULT`` in a fresh process; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as d:
        spec_path, res_path = os.path.join(d, "spec.json"), os.path.join(d, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        try:
            subprocess.run([sys.executable, "-m", module, spec_path, res_path], check=True, timeout=timeout)
            with open(res_path) as f:
                return json.load(f)
        except (subprocess.SubprocessError, OSError, ValueError) as e:  # one failed row must not lose the others
            return {"error": f"{type(e).__name__}: {e}"}


def _print_row(r: dict) -> None:
    if "output_tokens_per_s" in r:
        print(f"bench vl: {r['row']}: {r['output_tokens_per_s']:.1f} output tok/s, {r['requests_per_s']:.2f} req/s")
    else:
        print(f"bench vl: {r['row']}: failed: {r.get('error')}")


def format_table(rows: list[dict]) -> str:
    lines = ["| row | output tok/s | req/s | vs HF same dtype | vs best HF | what it is |",
             "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        if "output_tokens_per_s" not in r:
            lines.append(f"| {r['row']} | failed: {r.get('error')} | | | | {r['note']} |")
            continue
        same = f"{r['speedup_vs_hf_same_dtype']:.2f}x" if "speedup_vs_hf_same_dtype" in r else "–"
        best = f"{r['speedup_vs_best_hf']:.2f}x" if "speedup_vs_best_hf" in r else "–"
        note = r["note"] + (f" (batch {r['batch_size']})" if "batch_size" in r else "")
        note += f" ({r['output_len']} new tokens a request)" if "output_len" in r else ""
        tps, rps = f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}"
        lines.append(f"| {r['row']} | {tps} | {rps} | {same} | {best} | {note} |")
    return "\n".join(lines)


def child_main(spec_path: str, res_path: str) -> None:
    """One jaxserve row: build the engine, warm up, time LLM.generate over the workload."""
    import jax

    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    work_spec = spec["workload"]
    t0 = time.perf_counter()
    llm = LLM(**spec["engine_args"], use_tqdm_on_load=False)
    startup_s = time.perf_counter() - t0
    print(f"bench vl: engine ready in {startup_s:.1f} s; warming up", flush=True)
    vl_config = llm.llm_engine.mm_processor.config
    work = make_workload(vl_config, **work_spec)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=work_spec["output_len"])
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": img}} for ids, img in work]
    # Other images than the timed run's: the encoder and prefix caches cannot help it. The eager row (no
    # programs, but JAX still compiles each op per shape on first use) warms up on the prompts and 8 tokens.
    eager = spec["engine_args"].get("enforce_eager")
    warm = make_workload(vl_config, **work_spec, seed=1)
    llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}} for ids, img in warm],
                 params.clone(max_tokens=min(8, params.max_tokens)) if eager else params, use_tqdm=False)  # fmt: skip
    runner = llm.llm_engine.runner
    vision = runner.vision
    encoded, lazy = vision.num_encoded, runner.num_lazy_compiles + len(vision.compiled_buckets)
    print(f"bench vl: warm after {time.perf_counter() - t0:.1f} s; timing", flush=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "engine": "jaxserve", "dtype": llm.llm_engine.model_config.dtype, "elapsed_s": elapsed,
        "output_tokens": out_tokens, "input_tokens": in_tokens, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed, "requests_per_s": len(outs) / elapsed,
        "startup_s": startup_s, "images_encoded": vision.num_encoded - encoded,
        "lazy_compiles_timed": runner.num_lazy_compiles + len(vision.compiled_buckets) - lazy,
        "engine_info": llm.llm_engine.info(),
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
    }  # fmt: skip
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    child_main(sys.argv[1], sys.argv[2])

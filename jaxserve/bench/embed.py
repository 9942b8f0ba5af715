"""`jaxserve bench embed`: offline embeddings/s and tokens/s of an embedding model, optionally beside HF.

The workload is --num-prompts random token-id prompts of --min-len to --max-len tokens (uniform), the same
for both sides. With --compare-hf, HF transformers' AutoModel plus the checkpoint's pooling runs them as
sentence-transformers would (jaxserve.bench.hf_embed) in a subprocess first, and the ratio is reported; for a
sentence-transformers directory with weights, the library itself runs there too (its own ratio).
Both sides run in the engine's dtype (float32 on CPU, bfloat16 on accelerators, unless --dtype).

    jaxserve bench embed --model DIR [--compare-hf] [--num-prompts 1000 --min-len 8 --max-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import time


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("embed", help="offline embedding throughput (embeddings/s, tokens/s)")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=1000)
    p.add_argument("--min-len", "--min_len", dest="min_len", type=int, default=8)
    p.add_argument("--max-len", "--max_len", dest="max_len", type=int, default=128)
    p.add_argument("--compare-hf", "--compare_hf", dest="compare_hf", action="store_true",
                   help="also run HF AutoModel + the checkpoint's pooling, batched as sentence-transformers does "
                   "(needs torch)")
    p.add_argument("--hf-batch-size", "--hf_batch_size", dest="hf_batch_size", type=int, default=32,
                   help="HF's batch size (sentence-transformers' default: 32)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def workload(n: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of uniform random length in [min_len, max_len], ids clear of the special tokens."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"--min-len={min_len} and --max-len={max_len} are invalid: need 1 <= min-len <= max-len")
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 2), min(vocab_size, 30000)
    return [[rng.randrange(lo, hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench.latency import resolve_dtype
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.model_loader import resolve_model_path
    from jaxserve.models.loader.embedding import checkpoint_is_encoder
    from jaxserve.models.loader.pooling_config import read_pooling_config

    args = engine_args_from(ns)
    if args.runner == "auto" and args.task is None:
        args = dataclasses.replace(args, runner="pooling")  # a bench of embeddings: pool whatever the model is
    path, _ = resolve_model_path(args.model, args.load_format)
    with open(f"{path}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    prompts = workload(ns.num_prompts, ns.min_len, ns.max_len, vocab)
    tokens = sum(len(p) for p in prompts)
    dtype = resolve_dtype(args.dtype)
    hf = None
    if ns.compare_hf:  # first, in its own process, while no JAX process holds the device's memory
        from jaxserve.bench.hf_embed import run_in_subprocess

        pooling = read_pooling_config(path, is_encoder=checkpoint_is_encoder(path))
        hf = run_in_subprocess(path, prompts, ns.hf_batch_size, dtype, pooling.pooling_type, pooling.normalize)
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(batch[:4], use_tqdm=False)  # warm the host paths; the shapes are compiled at start-up
    start = time.perf_counter()
    llm.embed(batch, use_tqdm=True)
    elapsed = time.perf_counter() - start
    result = {
        "engine": "jaxserve",
        "model": engine.model_config.served_model_name,
        "workload": dict(num_prompts=ns.num_prompts, min_len=ns.min_len, max_len=ns.max_len),
        "tokens": tokens,
        "elapsed_s": elapsed,
        "embeddings_per_s": len(prompts) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "startup_s": startup_s,
        "engine_info": engine.info(),
        "engine_args": dataclasses.asdict(args),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"jaxserve: {len(prompts)} embeddings ({tokens} tokens) in {elapsed:.2f}s: "
          f"{result['embeddings_per_s']:.1f} embeddings/s, {result['tokens_per_s']:.0f} tokens/s")  # fmt: skip
    if hf is not None:
        result["hf"] = hf
        result["speedup_vs_hf"] = result["embeddings_per_s"] / hf["embeddings_per_s"]
        print(f"HF AutoModel + pooling (length-sorted batches of {ns.hf_batch_size}): "
              f"{hf['embeddings_per_s']:.1f} embeddings/s, {hf['tokens_per_s']:.0f} tokens/s -> "
              f"jaxserve is {result['speedup_vs_hf']:.2f}x")  # fmt: skip
        st = hf.get("sentence_transformers")
        if st is not None:
            result["speedup_vs_sentence_transformers"] = result["embeddings_per_s"] / st["embeddings_per_s"]
            print(f"sentence-transformers {st['version']} (its modules on the same token ids): "
                  f"{st['embeddings_per_s']:.1f} embeddings/s, {st['tokens_per_s']:.0f} tokens/s -> "
                  f"jaxserve is {result['speedup_vs_sentence_transformers']:.2f}x")  # fmt: skip
    print(json.dumps(result, indent=1))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

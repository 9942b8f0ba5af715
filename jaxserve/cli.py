"""The `jaxserve` command: generate, serve, convert, agreement, bench. Engine flags use vLLM's names (dashes or underscores)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from jaxserve.config import NOT_FLAGS, EngineArgs

_HELP = {
    "model": "HF model directory, .gguf file, `jaxserve convert` directory, or omit for the embedded default "
    "(SmolLM2-135M-Instruct)",
    "dtype": "auto (bfloat16 on GPU/TPU, float32 on CPU), float32, bfloat16, float16",
    "fp32_matmul_precision": "how float32 models multiply: highest (true float32, as PyTorch/HF) or tf32 (TF32 "
    "tensor cores on NVIDIA GPUs: faster, ~1e-3 relative error); bf16/fp16 models ignore it",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most sequences in one step (default 256 on accelerators, 64 on CPU)",
    "max_num_batched_tokens": "token budget of one step (default 2048 on accelerators, 16384 for offline LLM use there, 256 on CPU)",
    "block_size": "tokens per KV cache block",
    "kv_cache_dtype": "auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: KV in one byte a value",
    "calculate_kv_scales": "fp8 KV cache: set each layer's K/V scale from the first prefill's largest |K|, |V| "
    "(amax / the format's max), then keep it; overrides the checkpoint's scales",
    "gpu_memory_utilization": "fraction of accelerator memory the engine may use",
    "num_gpu_blocks_override": "fix the number of KV cache blocks",
    "cpu_kv_cache_space": "GiB of KV cache on CPU (default 1)",
    "enforce_eager": "run without the whole-step jit (slow; for debugging and comparison)",
    "async_scheduling": "dispatch each model step before reading the previous step's tokens back, so host work "
    "overlaps the device (--no-async-scheduling: one step at a time, for debugging and comparison)",
    "precompile": "step shapes compiled at start-up, the rest on first use: all, common (every token bucket at the "
    "shortest context width) or none; auto: all on GPU/TPU, common on CPU",
    "attention_backend": "auto (pallas on GPU/TPU, xla elsewhere), reference (plain jnp ground truth), xla (jnp that gathers little; fast on CPU) or pallas",
    "load_format": "auto, safetensors, gguf, orbax (a `jaxserve convert` directory) or dummy (random weights from "
    "the config)",
    "quantization": "fp8: quantize the projections and the head to fp8 (e4m3, a scale per output) once loaded: half "
    "the weight bytes of bf16, decode products ~1.6x faster on a GPU; gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1 weights "
    "quantized in memory (1.25 bytes a weight; native kernels on the CPU: a single stream ~1.5x faster, prompts and "
    "batches slower); none (the default): weights in --dtype",
    "reasoning_parser": "a reasoning model's <think> format, deepseek_r1 (DeepSeek-R1, QwQ) or qwen3: chat replies "
    "give the reasoning apart (\"reasoning\"), and structured outputs constrain only the answer after it",
    "structured_outputs_in_reasoning": "structured outputs constrain the reasoning too (from the reply's first "
    "token), as vLLM's enable_in_reasoning",
    "compilation_cache_dir": "JAX persistent compilation cache ('' disables; default ~/.cache/jaxserve/xla)",
    "tensor_parallel_size": "devices per replica: attention heads, KV heads and the MLP split over them",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'',
    "data_parallel_size": "engine replicas, each on its own tensor_parallel_size devices, behind a least-loaded router",
    "runner": "generate (an LM), pooling (embeddings: LLM.embed, /v1/embeddings) or auto (pooling for a "
    "sentence-transformers, BERT-family or bare *Model decoder checkpoint, else generate)",
    "enable_lora": "serve LoRA adapters (Hugging Face PEFT format) per request; with --lora-modules on the server",
    "max_loras": "LoRA adapters resident on the device at once (the step's LoRA work grows with it)",
    "max_lora_rank": "largest adapter rank served (smaller ranks are zero-padded to it)",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: --max-loras)",
    "lora_dtype": "dtype of the LoRA weights: auto (the model's), float32, bfloat16, float16",
    "task": "vLLM's older spelling of --runner: embed (pooling) or generate",
    "limit_mm_per_prompt": "vision-language models: most images per prompt, e.g. image=2 (or JSON '{\"image\": 2}')",
    "mm_processor_kwargs": 'vision-language models: image processor overrides as JSON, e.g. \'{"max_pixels": 401408}\'',
    "allowed_local_media_path": "vision-language models: the directory prompts may read images from (file:// URLs "
    "or paths); unset, no local file is read",
}


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """One flag per EngineArgs field; `--max-model-len` and `--max_model_len` both work."""
    group = parser.add_argument_group("engine options")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in NOT_FLAGS:
            continue
        if f.name == "model" and positional_model:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", default=None, help=_HELP["model"])
        names = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            names.append(f"--{f.name}")
        hint = hints[f.name]
        base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint
        help_text = _HELP.get(f.name, "") + (f" (default: {f.default})" if f.default not in (None, False) else "")
        if f.name in ("speculative_config", "limit_mm_per_prompt", "mm_processor_kwargs"):
            base = str  # JSON, parsed by jaxserve.spec_decode.config
        if base is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(*names, dest=f.name, type=base, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if f.name not in NOT_FLAGS}
    if getattr(ns, "model_pos", None) and not values["model"]:
        values["model"] = ns.model_pos
    return EngineArgs(**values)


def _cmd_generate(ns: argparse.Namespace) -> int:
    import time

    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed_sampling)
    prompt = ns.prompt
    start = time.perf_counter()
    if ns.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    dt = time.perf_counter() - start
    comp = out.outputs[0]
    print(comp.text)
    print(
        f"\n[{len(comp.token_ids)} tokens in {dt:.2f}s: {len(comp.token_ids) / dt:.1f} tokens/s, "
        f"finish_reason={comp.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="jaxserve: LLM serving on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it with tokens/s")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt as a user turn in the model's chat template (default: on)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0)
    gen.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=128)
    gen.add_argument("--seed-sampling", dest="seed_sampling", type=int, default=None, help="sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from jaxserve import convert

    # kept so that parse_args can read `convert`'s two positionals around its options
    parser.convert_parser = convert.add_parser(sub)

    try:
        from jaxserve.server.cli_args import add_serve_parser
    except ImportError:
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub, add_engine_args)

    from jaxserve.agreement import cli as agreement_cli

    agreement_cli.add_parser(sub, add_engine_args)

    bench = sub.add_parser("bench", help="benchmarks: throughput (offline), latency (single stream), ablation, serve (load generator), sweep, suite, load (start-up load phase), embed (embeddings/s), spec-decode (speculative decoding vs none), spec-sweep (forced acceptance 0..k), lora (multi-LoRA vs none), vl (vision-language vs HF), score (prompt logprobs, as evaluation harnesses score), structured (a JSON schema vs the same tokens unconstrained)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from jaxserve.bench import (
        ablation, embed, latency, load, lora, score, spec_decode, spec_sweep, structured, suite, sweep, throughput, vl,
    )

    for bench_module in (throughput, latency, ablation, sweep, suite, load, embed, score, structured, spec_decode, spec_sweep,
                         lora, vl):
        bench_module.add_parser(bench_sub, add_engine_args)
    try:
        from jaxserve.bench import serve as bench_serve
    except ImportError:
        bench_serve = None
    if bench_serve is not None:
        bench_serve.add_parser(bench_sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args``, except that `convert MODEL --dtype bfloat16 OUT_DIR` (options between the two
    positionals) works: argparse alone would take MODEL as OUT_DIR and reject the rest."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["convert"]:
        ns = parser.convert_parser.parse_intermixed_args(argv[1:])
        ns.command = "convert"
        return ns
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parse_args(parser, argv)
    try:
        return ns.func(ns) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

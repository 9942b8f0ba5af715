"""From EngineArgs to a ready engine: resolve defaults for this machine, load, size the cache, compile."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Optional

from jaxserve import reasoning
from jaxserve.config import (
    CacheConfig, EngineArgs, LoRAConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig,
)  # fmt: skip

logger = logging.getLogger("jaxserve")

# Defaults per platform: CPUs want small batches; accelerators want large ones.
_DEFAULTS = {
    "cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 256},
    "accel": {"max_num_seqs": 256, "max_num_batched_tokens": 2048},
}
# Offline (the LLM class) on accelerators, as vLLM does: a bigger step budget, since no request waits on another's
# step. Prompts then enter in a few large steps and the sequences finish nearly together, so the run's tail of
# ever smaller decode batches goes: 256 x 512 -> 256 on the H200, Llama-3-8B shape, 9,416 -> 9,720 output tok/s
# (2,048 -> 16,384; docs/BENCHMARKS.md §28). A server keeps 2,048: each prompt step delays every stream's
# next token.
_OFFLINE_ACCEL_BATCHED_TOKENS = 16384


def default_max_num_batched_tokens(platform: str, usage_context: str) -> int:
    """The step's token budget when none is given: by platform, and bigger for the offline LLM class on
    accelerators (``_OFFLINE_ACCEL_BATCHED_TOKENS``)."""
    if platform == "cpu":
        return _DEFAULTS["cpu"]["max_num_batched_tokens"]
    return _OFFLINE_ACCEL_BATCHED_TOKENS if usage_context == "llm" else _DEFAULTS["accel"]["max_num_batched_tokens"]


@dataclasses.dataclass
class EngineComponents:
    args: EngineArgs
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    runner_config: RunnerConfig
    text_config: Any
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    runner: Any
    scheduler: Any
    parallel_config: ParallelConfig = ParallelConfig()
    mesh: Any = None  # this engine's (1, tp) device mesh
    speculator: Any = None  # jaxserve.spec_decode.speculator.Speculator when speculative_config is set
    mm_processor: Any = None  # jaxserve.multimodal.MultiModalProcessor for a vision-language model
    reasoning: Any = None  # (format, <think> id, </think> id) under reasoning_parser (jaxserve.reasoning)


def enable_compilation_cache(cache_dir: Optional[str]) -> Optional[str]:
    """JAX's persistent compilation cache, on by default, so a second start skips compiling."""
    import jax

    if cache_dir == "":
        return None
    cache_dir = cache_dir or os.environ.get("JAXSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/jaxserve/xla")
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache_dir


def current_platform() -> str:
    import jax

    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def serving_dtype(dtype: str, platform: str) -> str:
    """The dtype the engine serves in: ``auto`` is float32 on CPU (no fast bf16 matmuls), bfloat16 elsewhere."""
    return dtype if dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")


def build_engine_components(
    args: EngineArgs, progress: bool = True, mesh: Any = None, before_warmup: Optional[Callable[[], None]] = None
) -> EngineComponents:
    """One engine (one data-parallel replica) on ``mesh``: a (1, tp) mesh from jaxserve.sharding, by default
    row 0 of the global mesh. DP engines call this once per replica with that replica's row.
    ``before_warmup()``, if given, runs after loading and before compiling (a DP replica waits there until
    replica 0 has filled the compilation cache)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve import sharding
    from jaxserve.model_loader import load_model, read_text_config, resolve_model_path
    from jaxserve.models.loader.weights import param_bytes
    from jaxserve.model_runner import ModelRunner
    from jaxserve.pallas_kernels.attention import (
        GATHER_BACKENDS, check_kv_cache_dtype, donating_kv, get_attention_fn, resolve_backend,
    )
    from jaxserve.scheduler import Scheduler

    args.validate()
    platform = current_platform()
    cache_dir = enable_compilation_cache(args.compilation_cache_dir)
    path, fmt = resolve_model_path(args.model, args.load_format)
    dtype = serving_dtype(args.dtype, platform)
    backend = resolve_backend(args.attention_backend, platform)
    check_kv_cache_dtype(args.kv_cache_dtype, backend, platform)  # before any weight is read
    tp = args.tensor_parallel_size
    attention_fn = get_attention_fn(backend, platform, tp)
    if mesh is None:
        mesh = sharding.replica_meshes(sharding.make_mesh(tp, args.data_parallel_size))[0]
    if tp > 1:
        sharding.check_tensor_parallel(read_text_config(path), tp)  # before any weight is read
        if backend not in GATHER_BACKENDS:  # a kernel is not split by XLA's partitioner: run it per device
            attention_fn = sharding.shard_attention(attention_fn, mesh)
    if args.enforce_eager:
        attention_fn = donating_kv(attention_fn)

    t0 = time.perf_counter()
    model, text_config = load_model(
        path, fmt, dtype=jnp.dtype(dtype), attention_fn=attention_fn, seed=args.seed,
        shardings_fn=sharding.shardings_fn(mesh), fp32_matmul_precision=args.fp32_matmul_precision, progress=progress,
        quantization=args.quantization, num_devices=tp,
    )
    jax.block_until_ready(nnx.state(model))  # loaders dispatch asynchronously: time the arrival
    weight_bytes = param_bytes(model)
    load_s = time.perf_counter() - t0
    tokenizer = None if args.skip_tokenizer_init else _tokenizer_or_none(path, fmt, args.tokenizer)
    tokenizer_s = time.perf_counter() - t0 - load_s
    tags = reasoning.reasoning_tags(args.reasoning_parser, tokenizer)  # a tokenizer without them fails before compiling

    model_max = text_config.max_position_embeddings
    max_model_len = args.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    defaults = _DEFAULTS["cpu" if platform == "cpu" else "accel"]
    max_num_seqs = args.max_num_seqs or defaults["max_num_seqs"]
    max_batched = args.max_num_batched_tokens or default_max_num_batched_tokens(platform, args.usage_context)
    if not args.enable_chunked_prefill:
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={args.max_num_batched_tokens} is smaller than max_model_len={max_model_len}; "
                "without chunked prefill a whole prompt must fit in one step: raise it, lower max_model_len, or "
                "enable chunked prefill"
            )
        max_batched = max(max_batched, max_model_len)
    max_num_seqs = min(max_num_seqs, max_batched)

    served = args.served_model_name or _default_served_name(args.model, path)
    model_config = ModelConfig(path, fmt, served, dtype, max_model_len, args.seed, args.fp32_matmul_precision)
    cache_config = CacheConfig(
        args.block_size, args.gpu_memory_utilization, args.num_gpu_blocks_override, args.cpu_kv_cache_space,
        args.kv_cache_dtype, args.enable_prefix_caching, args.calculate_kv_scales,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs, max_batched, max_model_len, args.enable_chunked_prefill, args.long_prefill_token_threshold
    )
    precompile = args.precompile if args.precompile != "auto" else ("common" if platform == "cpu" else "all")
    runner_config = RunnerConfig(
        args.enforce_eager, backend, cache_dir, platform, precompile,
        host_bound_steps=args.speculative_config is not None,
    )  # fmt: skip
    lora_config = _lora_config(args, dtype)
    mm_processor = _mm_processor(args, path, model)
    runner = ModelRunner(
        model, text_config, model_config, cache_config, scheduler_config, runner_config, mesh=mesh,
        lora_config=lora_config,
        mm_max_tokens_per_image=mm_processor.max_tokens_per_image if mm_processor is not None else 0,
        aux_hidden=_eagle_aux_hidden(args, text_config, jnp.dtype(dtype).itemsize),
    )  # fmt: skip
    del model
    scheduler = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        block_size=args.block_size,
        num_blocks=runner.num_blocks,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_loras=lora_config.max_loras if lora_config is not None else 0,
    )
    if before_warmup is not None:
        before_warmup()
    compile_s = runner.warmup(progress=progress)
    speculator = _speculator(args, runner, text_config, platform, mesh, progress)
    logger.info(
        "jaxserve ready: %s (%s, %s, tp=%d on %s) %.2f GB of weights loaded in %.1fs (%.2f GB/s), tokenizer %.1fs, "
        "%d KV blocks (%s), %d of %d step shapes compiled in %.1fs (precompile=%s; the rest compile on first use)",
        served, fmt, dtype, tp, [d.id for d in mesh.devices.flat], weight_bytes / 1e9, load_s,
        weight_bytes / 1e9 / max(load_s, 1e-9), tokenizer_s, runner.num_blocks, runner.kv_dtype.name,
        len(runner.compiled_shapes), runner.num_step_shapes, compile_s, precompile,
    )
    eos = set(text_config.eos_token_ids or ())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return EngineComponents(
        args, model_config, cache_config, scheduler_config, runner_config, text_config, tokenizer,
        tuple(sorted(eos)), runner, scheduler, ParallelConfig(tp, args.data_parallel_size), mesh, speculator,
        mm_processor, tags,
    )


def _lora_config(args: EngineArgs, dtype: str) -> Optional[LoRAConfig]:
    """LoRAConfig from the lora flags (vLLM's defaults: max_cpu_loras = max_loras), or None without enable_lora."""
    if not args.enable_lora:
        return None
    return LoRAConfig(
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras or args.max_loras,
        lora_dtype=dtype if args.lora_dtype == "auto" else args.lora_dtype,
    )
def _mm_processor(args: EngineArgs, path: str, model: Any) -> Any:
    """The image processor of a vision-language model (None for a text model); refuses what it cannot run."""
    import json

    from jaxserve.multimodal import MultiModalProcessor, parse_limit_mm_per_prompt

    vl_config = getattr(model, "vl_config", None)
    if vl_config is None:
        if args.limit_mm_per_prompt:
            logger.warning("limit_mm_per_prompt=%r is ignored: %s is a text-only model", args.limit_mm_per_prompt, path)
        return None
    for name, off in (("speculative_config", None), ("data_parallel_size", 1), ("enable_lora", False)):
        if getattr(args, name) != off:
            raise ValueError(
                f"{name}={getattr(args, name)!r} is not supported with a vision-language model yet; leave it unset"
            )
    kwargs = args.mm_processor_kwargs
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return MultiModalProcessor(path, vl_config, parse_limit_mm_per_prompt(args.limit_mm_per_prompt), kwargs)


def _speculator(args: EngineArgs, runner: Any, text_config: Any, platform: str, mesh: Any, progress: bool) -> Any:
    """The speculative-decoding parts (proposer, verify step), or None when speculative_config is unset."""
    from jaxserve.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse(args.speculative_config)
    if config is None:
        return None
    from jaxserve.spec_decode.speculator import Speculator

    draft = None
    if config.method == "draft_model":
        from jaxserve.spec_decode.draft_model import DraftProposer

        draft = DraftProposer.build(config, args, runner, text_config, mesh, progress)
    elif config.method in ("eagle", "eagle3"):
        from jaxserve.spec_decode.eagle import EagleProposer

        draft = EagleProposer.build(config, args, runner, text_config, progress)
    speculator = Speculator(config, runner, draft)
    if not args.enforce_eager:
        seconds = speculator.verifier.warmup()
        logger.info("speculative decoding (%s, k=%d): %d verify step shapes ready in %.1fs (%d loaded from the "
                    "executable store)", config.method, config.num_speculative_tokens,
                    len(speculator.verifier.startup_shapes()), seconds, speculator.verifier.num_loaded_programs)
    return speculator


def _eagle_aux_hidden(args: EngineArgs, text_config: Any, itemsize: int) -> Any:
    """With an EAGLE head, the target's hidden states it reads (and their width), which the target's steps then
    store; None otherwise (the steps are the plain ones)."""
    from jaxserve.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse(args.speculative_config)
    if config is None or config.method not in ("eagle", "eagle3"):
        return None
    from jaxserve.spec_decode.eagle import EagleProposer

    return EagleProposer.aux_hidden(config, text_config, itemsize)


def _tokenizer_or_none(path: str, fmt: str, tokenizer: Optional[str]):
    """The model's tokenizer. A dummy-weight run from a config-only directory (benchmarks) may have none:
    it then serves token-id prompts only, as with skip_tokenizer_init."""
    from jaxserve.model_loader import load_tokenizer
    from jaxserve.models.loader.orbax_format import has_tokenizer

    try:
        return load_tokenizer(path, tokenizer)
    except ValueError:
        # a checkpoint converted from such a config-only directory has none either, and says so
        tokenizer_free = fmt == "dummy" or (fmt == "orbax" and not has_tokenizer(path))
        if not tokenizer_free or tokenizer is not None:
            raise
        logger.warning("no tokenizer found beside %s: this model will take token-id prompts only", path)
        return None


def _default_served_name(model: Optional[str], path: str) -> str:
    if model is None:
        from jaxserve.models.loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return model

"""EngineArgs (flags named as vLLM's) and the frozen, grouped configs they are parsed into once.

Values found at run time (the number of KV blocks that fit, the compiled buckets) are returned by the
model runner; they are never written back into these configs.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "fp8" means fp8_e4m3, as in vLLM; dashes work too (fp8-e5m2). The JAX dtypes: pallas_kernels/fp8.py.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "orbax", "dummy")
QUANTIZATIONS = ("fp8", "gguf", "none")  # None is none (models/fp8_weights.py, models/quantized.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # jaxserve/reasoning.py, which this mirrors
# How float32 matmuls run (jaxserve.pallas_kernels.precision, which this mirrors without importing JAX):
# "highest" is true float32, as PyTorch computes by default; "tf32" lets NVIDIA GPUs round inputs to TF32.
FP32_MATMUL_PRECISIONS = ("highest", "tf32")
# Which step shapes compile at start-up (the rest compile on first use): see jaxserve.buckets.startup_shapes.
PRECOMPILE = ("auto", "all", "common", "none")
RUNNERS = ("auto", "generate", "pooling")
USAGE_CONTEXTS = ("engine", "llm")  # EngineArgs.usage_context
NOT_FLAGS = {"usage_context"}  # EngineArgs fields set by the code that builds the engine: no command-line flag
TASKS = ("auto", "generate", "embed", "embedding")


@dataclasses.dataclass
class EngineArgs:
    """Every engine option, with vLLM's names. ``None`` means "pick a good default for this machine"."""

    model: Optional[str] = None  # HF dir, .gguf file (or dir of one), `jaxserve convert` dir; None: the default
    tokenizer: Optional[str] = None  # defaults to the model's own
    served_model_name: Optional[str] = None
    dtype: str = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU
    fp32_matmul_precision: str = "highest"  # highest | tf32: float32 models only (faster, ~1e-3 relative error)
    max_model_len: Optional[int] = None  # defaults to the model's max_position_embeddings
    max_num_seqs: Optional[int] = None  # defaults: 256 on accelerators, 64 on CPU
    max_num_batched_tokens: Optional[int] = None  # defaults: 2048 on accelerators (16384 for the LLM class), 256 on CPU
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: Optional[int] = None  # fix the number of KV blocks (tests, experiments)
    cpu_kv_cache_space: Optional[float] = None  # GiB of KV cache on CPU (default 1 GiB, bounded by need)
    kv_cache_dtype: str = "auto"
    # fp8 caches: each layer's K/V scale = amax of the first prefill's K/V / the format's max, then fixed
    # (jaxserve/kv_scale_calibration.py); overrides the checkpoint's scales.
    calculate_kv_scales: bool = False
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    enforce_eager: bool = False
    # Dispatch step N+1 before reading step N's tokens back (the host's work overlaps the device's).
    async_scheduling: bool = True
    # Step shapes compiled at start-up: all (every bucket), common (each token bucket at the shortest context
    # width), none; the rest compile on first use. auto: all on accelerators, common on CPU (where each shape
    # costs seconds).
    precompile: str = "auto"
    attention_backend: str = "auto"  # auto | reference | xla | pallas
    load_format: str = "auto"  # auto | safetensors | gguf | orbax (a `jaxserve convert` directory) | dummy
    # gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1 weights quantized in memory (models/quantized.py); fp8: quantize the
    # projections and head to e4m3 with a scale per output once loaded (models/fp8_weights.py); none (or None):
    # dequantize a GGUF file's weights at load to dtype.
    quantization: Optional[str] = None
    skip_tokenizer_init: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_logprobs: int = 20
    compilation_cache_dir: Optional[str] = None  # JAX's persistent compilation cache; "" turns it off
    trust_remote_code: bool = False
    # Multi-LoRA serving (jaxserve.lora): PEFT adapters per request, several in one step.
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident on the device at once (device slots; the step's compute grows with it)
    max_lora_rank: int = 16  # adapters of lower rank are zero-padded to it
    max_cpu_loras: Optional[int] = None  # adapters kept read on the host (default: max_loras)
    lora_dtype: str = "auto"  # auto: the model's dtype
    disable_log_stats: bool = False
    # Which runner serves the model: generate (an LM), pooling (embeddings), auto (from the checkpoint: a
    # sentence-transformers directory, a BERT-family encoder or a bare *Model decoder is pooling).
    runner: str = "auto"
    task: Optional[str] = None  # vLLM's older spelling: "embed" means runner="pooling", "generate" generate
    # Speculative decoding, as vLLM's dict: {"method": "ngram" | "draft_model" | "eagle" | "eagle3",
    # "num_speculative_tokens": k, "prompt_lookup_min"/"prompt_lookup_max" (ngram), "model" (draft_model: a
    # checkpoint; eagle, eagle3: an EAGLE head's directory)}; a JSON string from the CLI.
    speculative_config: Optional[Any] = None
    # Vision-language models: most images one prompt may carry ({"image": N}, or "image=N" from the CLI);
    # the image processor's overrides (e.g. {"max_pixels": 401408}); the directory under which prompts may
    # name local image files (file:// URLs or paths). Unset: no local files are read.
    limit_mm_per_prompt: Optional[Any] = None
    mm_processor_kwargs: Optional[Any] = None
    allowed_local_media_path: Optional[str] = None
    # Reasoning models (jaxserve/reasoning.py): the format of their <think> blocks. The server then answers chat
    # with the reasoning apart ("reasoning"), and structured outputs constrain only the answer after the reasoning,
    # unless structured_outputs_in_reasoning (vLLM's structured_outputs_config.enable_in_reasoning).
    reasoning_parser: Optional[str] = None
    structured_outputs_in_reasoning: bool = False
    # Who runs the engine, as vLLM's usage context: "llm" (the offline LLM class, which sets it) or "engine" (a
    # server, the CLI's other commands). It picks defaults only (max_num_batched_tokens: engine_setup.py); no flag.
    usage_context: str = "engine"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """Build from keyword options; an unknown option is an error naming the closest known ones."""
        known = set(cls.field_names())
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ValueError(f"unknown engine option {key!r}{hint} (known options: {', '.join(sorted(known))})")
        return cls(**kwargs)

    def validate(self) -> None:
        """Reject values no engine could run with, naming the option and what would work."""

        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {want}")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose one of {DTYPES}")
        if self.fp32_matmul_precision not in FP32_MATMUL_PRECISIONS:
            want = "'highest' (true float32) or 'tf32' (TF32 matmuls on NVIDIA GPUs: faster, less exact)"
            raise bad("fp32_matmul_precision", f"choose one of {FP32_MATMUL_PRECISIONS}: {want}")
        if str(self.kv_cache_dtype).replace("-", "_") not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"choose one of {KV_CACHE_DTYPES} (fp8 is fp8_e4m3)")
        if self.calculate_kv_scales and str(self.kv_cache_dtype).replace("-", "_") == "auto":
            want = "scales exist only for an fp8 cache: set kv_cache_dtype='fp8' too, or leave it off"
            raise bad("calculate_kv_scales", want)
        if self.usage_context not in USAGE_CONTEXTS:
            raise bad("usage_context", f"choose one of {USAGE_CONTEXTS}")
        if self.precompile not in PRECOMPILE:
            raise bad("precompile", f"choose one of {PRECOMPILE}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"choose one of {LOAD_FORMATS}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"choose one of {QUANTIZATIONS}, or leave it unset (none)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise bad("reasoning_parser", f"choose one of {REASONING_PARSERS}, or leave it unset")
        if self.structured_outputs_in_reasoning and self.reasoning_parser is None:
            raise bad("structured_outputs_in_reasoning", "it says how structured outputs treat a reasoning "
                      "model's reasoning: set reasoning_parser too, or leave it off")
        if self.attention_backend not in ("auto", "reference", "xla", "pallas"):
            raise bad("attention_backend", "choose one of ('auto', 'reference', 'xla', 'pallas')")
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 128:
            raise bad("block_size", "must be a power of two between 1 and 128")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(name, "must be a positive integer (or unset for the default)")
        if self.cpu_kv_cache_space is not None and self.cpu_kv_cache_space <= 0:
            raise bad("cpu_kv_cache_space", "must be a positive number of GiB")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise bad(name, "must be a positive integer (devices per replica / number of replicas)")
        if self.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise bad(name, "must be a positive integer")
            if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras):
                raise bad("max_cpu_loras", f"must be an integer >= max_loras={self.max_loras} (or unset)")
            if self.lora_dtype not in DTYPES:
                raise bad("lora_dtype", f"choose one of {DTYPES}")
            if self.speculative_config is not None:
                raise bad("enable_lora", "LoRA with speculative decoding is not supported; drop one of them")
            if self.enforce_eager:
                raise bad("enable_lora", "LoRA runs in the jitted step only; drop enforce_eager")
        if self.trust_remote_code:
            raise bad("trust_remote_code", "jaxserve runs only its own model code; leave it False")
        if self.runner not in RUNNERS:
            raise bad("runner", f"choose one of {RUNNERS}")
        if self.task is not None and self.task not in TASKS:
            raise bad("task", f"choose one of {TASKS} (or set runner= instead)")
        if self.max_logprobs < 0 or self.max_logprobs > 20:
            raise bad("max_logprobs", "must be in [0, 20]")
        from jaxserve.multimodal import parse_limit_mm_per_prompt

        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # raises, naming the value and what works
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, (dict, str)):
            raise bad("mm_processor_kwargs", 'pass a dict (or JSON), e.g. {"max_pixels": 401408}')
        from jaxserve.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)  # raises, naming the key, the value and what works


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What model runs, in which dtype, over how long a context."""

    model: str  # resolved path
    model_format: str  # "safetensors" | "gguf" | "orbax" | "dummy"
    served_model_name: str
    dtype: str  # "float32" | "bfloat16" | "float16" (resolved)
    max_model_len: int
    seed: int
    fp32_matmul_precision: str = "highest"  # "highest" | "tf32"; matters only when dtype is float32


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (present only with enable_lora)."""

    max_loras: int  # device slots besides slot 0 (no adapter)
    max_lora_rank: int
    max_cpu_loras: int  # resolved: >= max_loras
    lora_dtype: str  # resolved: "float32" | "bfloat16" | "float16"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    num_gpu_blocks_override: Optional[int]
    cpu_kv_cache_space: Optional[float]
    kv_cache_dtype: str
    enable_prefix_caching: bool
    calculate_kv_scales: bool = False  # fp8 only: scales from the first prefill (kv_scale_calibration.py)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    enforce_eager: bool
    attention_backend: str  # resolved: "reference" | "xla" | "pallas"
    compilation_cache_dir: Optional[str]  # resolved: None when off
    platform: str  # "cpu" | "gpu" | "tpu"
    precompile: str = "all"  # resolved: "all" | "common" | "none"
    # Every step's launch waits for the host's reading of the step before it (a speculative engine's loop), so
    # the steps launch kernel by kernel on GPUs (jaxserve.launch_mode).
    host_bound_steps: bool = False

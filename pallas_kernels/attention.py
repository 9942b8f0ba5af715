"""One entry point for attention over the paged cache; the backend is chosen once, at start-up."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxserve.pallas_kernels.metadata import AttentionMetadata
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference, write_kv

ATTENTION_BACKENDS = ("auto", "reference", "xla", "pallas")

# Backends that gather context with jnp: they want context-width buckets and are split by XLA's partitioner.
GATHER_BACKENDS = ("reference", "xla")

# Backends that read and write an fp8 KV cache (kv_cache_dtype fp8*): all of them, the TPU op's included.
FP8_BACKENDS = ("reference", "xla", "pallas")


def check_kv_cache_dtype(kv_cache_dtype: str, backend: str, platform: str) -> None:
    """Refuse an fp8 cache where the backend cannot read it, rather than serve wrong attention."""
    if kv_cache_dtype == "auto":
        return
    if backend not in FP8_BACKENDS:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by attention_backend={backend!r}; use one of "
            f"{', '.join(FP8_BACKENDS)} with an fp8 cache, or kv_cache_dtype='auto' with {backend!r}"
        )

# (q, k_new, v_new, k_pages, v_pages, md, *, scale, sliding_window, precision) -> (out, k_pages, v_pages);
# precision (of the attention's products) None means "from q's dtype": float32 exact (see precision.py).
# Over an fp8 cache the model also passes k_scale and v_scale (fp8.py); only FP8_BACKENDS take them.
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def paged_attention(
    q: jax.Array,  # [T, H, D]
    k_new: jax.Array,  # [T, K, D]
    v_new: jax.Array,  # [T, K, D]
    k_pages: jax.Array,  # [N, P, K, D]
    v_pages: jax.Array,  # [N, P, K, D]
    md: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    precision: jax.lax.Precision | None = None,
    k_scale=1.0,  # fp8 caches only (fp8.py): per-layer scales, traced scalars
    v_scale=1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reference backend: write this step's KV into its slots, then attend. Returns (out[T,H,D], k_pages, v_pages)."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k_new, v_new, md.slot_mapping, k_scale, v_scale)
    out = ragged_paged_attention_reference(
        q, k_pages, v_pages, md, scale=scale, sliding_window=sliding_window, precision=precision,
        k_scale=k_scale, v_scale=v_scale,
    )
    return out, k_pages, v_pages


def resolve_backend(name: str, platform: str) -> str:
    """'auto' means the Pallas kernel on GPU/TPU and the gather-light jnp ('xla') backend elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
    if name == "auto":
        return "pallas" if platform in ("gpu", "cuda", "tpu") and _pallas_available(platform) else "xla"
    return name


def _pallas_available(platform: str) -> bool:
    try:
        from jaxserve.pallas_kernels import paged_attention_pallas  # noqa: F401
    except ImportError:
        return False
    return True


# Every backend's keyword arguments that select a compiled variant rather than carry data.
_STATIC_ARGNAMES = ("scale", "sliding_window", "precision")


@functools.cache
def get_attention_fn(name: str, platform: str, tensor_parallel: int = 1) -> AttentionFn:
    # Every backend comes wrapped in a jit of its own: every layer calls attention with the same shapes, so
    # it is traced and lowered once per step shape instead of once per layer. XLA inlines the call; the
    # step runs the same. Measured: tracing the xla backend's loops 30 times was ~1.2 s of each shape's
    # start-up on CPU; lowered per layer, the Mosaic GPU prefill kernel was built 32 times per step shape of
    # an 8B model (~2.9 s each on the H200: 105 s per shape instead of ~16 s).
    fn = _backend_fn(resolve_backend(name, platform), platform, tensor_parallel)
    return jax.jit(fn, static_argnames=_STATIC_ARGNAMES)


def donating_kv(fn: AttentionFn) -> AttentionFn:
    """For enforce_eager: attention as a program of its own that takes the layer's K and V pages as donated
    buffers, so that the in-place KV write reuses them. Without donation every eager call copies the layer's
    pages while the runner still holds the originals: by the end of a step the cache existed twice (a 7B
    Qwen2-VL ran out of memory on the H200 at gpu_memory_utilization 0.9, 2026-12-01). Inside a jitted step
    the call is inlined and the step's own donation applies; this one is then ignored."""
    return jax.jit(fn, static_argnames=_STATIC_ARGNAMES, donate_argnums=(3, 4))


def _backend_fn(backend: str, platform: str, tensor_parallel: int = 1) -> AttentionFn:
    if backend == "reference":
        return paged_attention
    if backend == "xla":
        from jaxserve.pallas_kernels import cpu_native
        from jaxserve.pallas_kernels.xla_attention import paged_attention_xla

        # On the CPU its decode rows go to a C++ kernel (cpu_native.py), unless the heads are split over devices:
        # XLA's partitioner cannot split a custom call, and would gather the whole cache onto every device for it.
        if platform == "cpu" and tensor_parallel == 1 and cpu_native.available():
            return functools.partial(paged_attention_xla, native=True)
        return paged_attention_xla
    try:
        from jaxserve.pallas_kernels.paged_attention_pallas import paged_attention_pallas
    except ImportError as e:
        raise ValueError(f"attention_backend='pallas' could not be loaded ({e}); use attention_backend='xla'") from e
    # Off-accelerator the kernels run in Pallas interpret mode: slow, exact, for tests and CI.
    return functools.partial(paged_attention_pallas, platform=platform, interpret=platform not in ("gpu", "tpu"))

"""What the Mosaic GPU kernels (``mosaic_prefill``, ``mosaic_decode``) share: the lazy import of jax's young
Mosaic GPU Pallas API, its interpreter's settings, and whether this jax and this device can run them."""

from __future__ import annotations

import jax

SMEM_BYTES = 232448  # the H100/H200 shared-memory limit per CTA, as Mosaic GPU reports it


def plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, imported only when a kernel is built (its API changes often)."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def load(ref, **kwargs):
    """``plgpu.load`` of a whole (already indexed) ref in a register layout, on every jax we support: jax 0.10
    takes the index as a required argument, jax 0.11 deprecates passing it (index the ref with ``.at``), and jax
    0.12 removed the argument."""
    import inspect

    fn = plgpu().load
    idx = inspect.signature(fn).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return fn(ref, (), **kwargs)
    return fn(ref, **kwargs)


def store_unplanned(ref, value, interpret: bool) -> None:
    """``ref[...] = value`` through the plain per-thread transfer. jax 0.12 plans every register store and
    refuses one that misses its rules (whole 32-byte sectors in global memory, no bank conflicts in shared
    memory) unless asked for an unplanned one with ``plgpu.store(..., optimized=False)``; earlier jax stores
    them that way without asking. The interpreter takes the plain assignment."""
    fn = None if interpret else getattr(plgpu(), "store", None)
    if fn is None:
        ref[...] = value
    else:
        fn(ref, value, optimized=False)


def interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    # TMA fills rows past an array's end; the interpreter, told so, returns NaN there (only unstored rows see it).
    return InterpretGPUParams(out_of_bounds_reads="uninitialized")


def runtime_reason(interpret: bool, needs: tuple[str, ...]) -> str | None:
    """Why a Mosaic GPU kernel cannot run here, or None: this jax lacks one of the API names ``needs``
    (attribute paths under the Pallas module, e.g. "Layout.WGMMA"), has no interpret mode, or the device is
    not Hopper (wgmma)."""
    try:
        mod = plgpu()
        for name in needs:
            obj = mod
            for part in name.split("."):
                obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        return f"Mosaic GPU Pallas unavailable ({e})"
    if interpret:
        try:
            interpret_params()
        except ImportError as e:
            return f"no Mosaic GPU interpret mode in this jax ({e})"
        return None
    dev = jax.devices()[0]
    if dev.platform != "gpu" or getattr(dev, "compute_capability", None) != "9.0":
        return f"device {getattr(dev, 'device_kind', dev.platform)} (wgmma needs compute capability 9.0)"
    return None


def wgmma_layout_helpers(interpret: bool):
    """``(cast, iota)`` for kernel code that runs compiled and interpreted alike: ``cast(x, layout)`` and an
    int32 ``iota(shape, dim)`` in the wgmma register layout. Register layouts matter to the compiler only;
    the interpreter takes plain arrays."""
    from jax import lax
    import jax.numpy as jnp

    if interpret:
        return (lambda x, layout: x), (lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim))
    mod = plgpu()
    iota = lambda shape, dim: mod.broadcasted_iota(jnp.int32, shape, dim, layout=mod.Layout.WGMMA)  # noqa: E731
    return mod.layout_cast, iota

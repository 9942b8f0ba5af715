"""Native CPU kernels: C++ sources next to this file, compiled on first use and called as XLA FFI custom calls.

XLA:CPU emits every jnp op from a fixed set of building blocks, and one of them costs the CPU's decode more than
its bytes say: gathering each sequence's pages before attending (docs/BENCHMARKS.md §35). The kernels here do
that one job by hand; the jnp code they replace stays, as their reference and as the fallback.

Building: the first process that needs a kernel compiles it with the system's C++ compiler (``$CXX`` or ``g++``,
~10 s) against the XLA FFI headers that jaxlib ships, for this machine's CPU (``-march=native``), and keeps the
shared library under the cache directory (``$JAXSERVE_CACHE_DIR/..`` or ``~/.cache/jaxserve``), named by a hash
of the source and the headers beside it, the compiler, jaxlib and the CPU, so that later starts load it at once.
No compiler, or a build that fails: a warning, and the jnp path serves instead. ``JAXSERVE_CPU_KERNELS=0`` turns
the kernels off; ``JAXSERVE_CPU_KERNELS=attention`` (a comma list) keeps only those named.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import glob
import math
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import numpy as np

logger = logging.getLogger("jaxserve")

_HERE = os.path.dirname(os.path.abspath(__file__))
# The C++ sources, built together into one shared library: its helper threads (cpu_threads.h) then serve every
# kernel, rather than one crew per library spinning beside the other.
_SOURCES = ("cpu_decode_attention.cc", "cpu_gemv.cc", "cpu_gemm.cc", "cpu_qgemm.cc")
# Each kernel: the FFI targets it defines (target name -> exported handler symbol).
_KERNELS = {
    "attention": {"jaxserve_cpu_decode_attention": "JaxserveCpuDecodeAttention"},
    "gemv": {"jaxserve_cpu_gemv": "JaxserveCpuGemv", "jaxserve_cpu_gemv_t": "JaxserveCpuGemvT",
             "jaxserve_cpu_gemv_bf16": "JaxserveCpuGemvBf16", "jaxserve_cpu_gemv_t_bf16": "JaxserveCpuGemvTBf16"},
    "gemm": {"jaxserve_cpu_gemm": "JaxserveCpuGemm"},
    "qgemm": {"jaxserve_cpu_qgemm": "JaxserveCpuQgemm", "jaxserve_cpu_qgemm_t": "JaxserveCpuQgemmT",
              "jaxserve_cpu_dequantize": "JaxserveCpuDequantize"},
}
# Cache dtypes the kernel reads; others (fp8) take the jnp path. uint16 is a bf16 cache's bits (fp8.BF16_BITS:
# how the CPU's gather backends store bf16).
KERNEL_KV_DTYPES = ("float32", "bfloat16", "uint16")
# -fno-math-errno and -fopenmp-simd let the loops vectorize (the pragmas need no OpenMP runtime).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


def enabled(kernel: str | None = None) -> bool:
    """The user's switch, ``JAXSERVE_CPU_KERNELS``: 1 (the default) for every kernel, 0 (or false/off/no) for none,
    or a comma list of kernel names ("attention", "gemv", "gemm", "qgemm") for those alone. ``kernel=None`` asks
    whether any is on."""
    value = os.environ.get("JAXSERVE_CPU_KERNELS", "1").strip().lower()
    if value in ("0", "false", "off", "no", ""):
        return False
    if value in ("1", "true", "on", "yes", "all"):
        return True
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = names - set(_KERNELS)
    if unknown:
        raise ValueError(f"JAXSERVE_CPU_KERNELS={value!r} names no kernel {sorted(unknown)}: use 1 (all), 0 (none) "
                         f"or a comma list of {sorted(_KERNELS)}")
    return kernel is None or kernel in names


def _cache_root() -> str:
    xla_dir = os.environ.get("JAXSERVE_CACHE_DIR")  # the compilation cache's folder: keep the builds beside it
    base = os.path.dirname(os.path.abspath(xla_dir)) if xla_dir else os.path.expanduser("~/.cache/jaxserve")
    return os.path.join(base, "cpu_kernels")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _build(cxx: str, include_dir: str) -> str:
    """The shared library of every source, for this compiler, jaxlib and CPU: loaded from the cache or compiled
    into it."""
    import jaxlib

    paths = [os.path.join(_HERE, name) for name in _SOURCES]
    text = b""
    for path in [*paths, *sorted(glob.glob(os.path.join(_HERE, "*.h")))]:  # the headers they include count too
        with open(path, "rb") as f:
            text += os.path.basename(path).encode() + b"\0" + f.read() + b"\0"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        text, version, " ".join(_FLAGS), jaxlib.__version__, include_dir, _cpu_identity()))).hexdigest()[:24]
    root = _cache_root()
    path = os.path.join(root, f"cpu_kernels-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(root, exist_ok=True)
    logger.info("compiling jaxserve's CPU kernels (once per machine, a few seconds)")
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *_FLAGS, f"-I{include_dir}", *paths, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders (DP processes, test workers) never see half a file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@functools.cache
def loaded(kernel: str) -> bool:
    """Whether ``kernel`` ("attention" or "gemv") is built and registered with XLA:CPU (built on the first call)."""
    if not enabled(kernel):
        return False
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        logger.warning("no C++ compiler found (g++, c++, clang++ or $CXX): the CPU uses its jnp path, slower")
        return False
    try:
        import jax

        lib = ctypes.cdll.LoadLibrary(_build(cxx, jax.ffi.include_dir()))
        for target, symbol in _KERNELS[kernel].items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure leaves the jnp path, which is always correct
        logger.warning("could not build jaxserve's CPU kernels (%s: %s); using the jnp path for %s",
                       type(e).__name__, e, kernel)  # fmt: skip
        return False
    return True


def available() -> bool:
    """Whether the decode-attention kernel is built and registered with XLA:CPU (builds it on the first call)."""
    return loaded("attention")


available.cache_clear = loaded.cache_clear  # type: ignore[attr-defined]  # tests reset the build state


def reads(kv_dtype) -> bool:
    """Whether the kernel reads a cache of this dtype (fp8 caches take the jnp path)."""
    import jax.numpy as jnp

    return jnp.dtype(kv_dtype).name in KERNEL_KV_DTYPES


def decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale: float, sliding_window: int | None):
    """Each sequence's query rows over its own pages, read in place (cpu_decode_attention.cc).

    q [S, K, G, D] float32; pages [N, K, P, D] float32 or bfloat16 (heads-major); block_tables [S, B] and
    seq_lens [S] int32. Returns [S, K, G, D] float32. Call only where ``available()`` is True.
    """
    import jax.numpy as jnp

    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    return paged_attention(q, k_pages, v_pages, block_tables, rows, seq_lens, scale=scale,
                           sliding_window=sliding_window)  # fmt: skip


def paged_attention(q, k_pages, v_pages, block_tables, row_tables, row_lens, *, scale: float,
                    sliding_window: int | None):  # fmt: skip
    """Each query row over the pages of the sequence it names, up to the length it sees (cpu_decode_attention.cc).

    q [R, K, G, D] float32 (a row: a token's query heads, grouped by KV head); pages [N, K, P, D] float32 or
    bfloat16 (heads-major); block_tables [S, B]; row_tables [R] (the row's sequence) and row_lens [R] (its position
    + 1; 0 for a padding row, whose output is zeros) int32. Returns [R, K, G, D] float32. Call only where
    ``available()`` is True.
    """
    import jax
    import jax.numpy as jnp

    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxserve_cpu_decode_attention", out)(
        q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32), row_tables.astype(jnp.int32),
        row_lens.astype(jnp.int32), scale=np.float32(scale),
        window=np.int32(-1 if sliding_window is None else sliding_window),
    )


# Native products (cpu_gemv.cc: one row; cpu_gemm.cc: a few rows). Only programs that run on one device may use
# them: XLA's partitioner cannot split a custom call, and under TP would gather every weight onto every device for
# it. The step program that the runner compiles says so at trace time (``products``); everything else traces the
# plain product.
_products = contextvars.ContextVar("jaxserve_cpu_native_products", default=False)


@contextlib.contextmanager
def products(allowed: bool):
    """Within this block (a trace), products of a few rows may take the native kernels (``matvec``, ``gemm``)."""
    token = _products.set(bool(allowed))
    try:
        yield
    finally:
        _products.reset(token)


# The dtypes the one-row kernels read (x and the weight alike): their FFI targets' suffix.
_MATVEC_SUFFIX = {"float32": "", "bfloat16": "_bf16"}


def use_matvec(x, kernel) -> bool:
    """Whether ``x [1, K] @ kernel [K, ...]`` (or a tied head's one row) goes to the native kernel: the trace allows it,
    one row, both operands float32 or both bfloat16, and the kernel is built."""
    return (
        _products.get() and x.ndim == 2 and x.shape[0] == 1 and x.dtype == kernel.dtype
        and str(x.dtype) in _MATVEC_SUFFIX and loaded("gemv")
    )  # fmt: skip


# Rows up to which a float32 product takes the native few-row kernel (cpu_gemm.cc): from 2 to 48 rows it took
# 20-41% less time than XLA:CPU's GEMM over a model's worth of projections, at 64 rows 11% less; from 96 rows on
# the two were equal (docs/BENCHMARKS.md §37, python -m jaxserve.bench.cpu_gemm_rows).
GEMM_MAX_ROWS = 64


@functools.cache
def _has_avx512() -> bool:
    """Whether this CPU has AVX-512 (cpu_gemm.cc's hand-written tiles need it)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def use_gemm(x, kernel) -> bool:
    """Whether ``x [M, K] @ kernel [K, ...]`` goes to the native few-row kernel: the trace allows native products,
    2 <= M <= GEMM_MAX_ROWS, both operands float32, the CPU has AVX-512, and the kernel is built. Without AVX-512
    the kernel's plain loops lost to XLA:CPU's GEMM (a 2-core AMD EPYC with AVX2: equal at 16 rows, 511 against
    214 ms at 64; docs/BENCHMARKS.md §44)."""
    return (
        _products.get() and x.ndim == 2 and 2 <= x.shape[0] <= GEMM_MAX_ROWS and x.dtype == kernel.dtype == "float32"
        and _has_avx512() and loaded("gemm")
    )  # fmt: skip


def gemm(x, kernel):
    """x [M, K] @ kernel [K, *out] -> [M, *out] float32 (float32 sums), on every core (cpu_gemm.cc)."""
    import jax
    import jax.numpy as jnp

    out = kernel.shape[1:]
    n = math.prod(out)
    y = jax.ffi.ffi_call("jaxserve_cpu_gemm", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, kernel.reshape(kernel.shape[0], n)
    )
    return y.reshape(x.shape[0], *out)


def matvec(x, kernel):
    """x [1, K] @ kernel [K, *out] -> [1, *out] float32 (sums in float32), on every core (cpu_gemv.cc)."""
    import jax
    import jax.numpy as jnp

    out = kernel.shape[1:]
    n = math.prod(out)
    target = "jaxserve_cpu_gemv" + _MATVEC_SUFFIX[str(kernel.dtype)]
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((n,), jnp.float32))(
        x.reshape(-1), kernel.reshape(kernel.shape[0], n)
    )
    return y.reshape(1, *out)


def matvec_t(table, x):
    """table [N, K] times x [1, K] -> [1, N] float32 (a tied head: rows of the table dotted with the row)."""
    import jax
    import jax.numpy as jnp

    target = "jaxserve_cpu_gemv_t" + _MATVEC_SUFFIX[str(table.dtype)]
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((table.shape[0],), jnp.float32))(table, x.reshape(-1))
    return y[None]


# Rows up to which a product with block-quantized weights (models/quantized.py) takes the native kernel
# (cpu_qgemm.cc); larger products (long prefill chunks) dequantize the weight and take XLA:CPU's GEMM. Over a
# model's worth of projections on a 2-core AMD EPYC (AVX2) the kernel took 404 ms at 128 rows against 513 ms
# dequantized, and was even at 256 rows (659 against 647 ms; docs/BENCHMARKS.md §44).
QGEMM_MAX_ROWS = 256


def use_native_dequantize(x) -> bool:
    """Whether a block-quantized weight is dequantized by the native kernel (cpu_qgemm.cc) for a product of ``x``
    too large for qgemm: the trace allows native products, x float32 and the kernel is built. With the jnp
    dequantization instead, a 123-token prompt's first token took 1,974 ms against 777 (docs/BENCHMARKS.md §44)."""
    return _products.get() and x.dtype == "float32" and loaded("qgemm")


def dequantize(codes, scale, offset):
    """codes [K, *out] int8, scale and offset [K/G, *out] -> the float32 weight [K, *out] (cpu_qgemm.cc)."""
    import jax
    import jax.numpy as jnp

    out = codes.shape[1:]
    n = math.prod(out)
    flat = lambda a: a.reshape(a.shape[0], n)  # noqa: E731
    w = jax.ffi.ffi_call("jaxserve_cpu_dequantize", jax.ShapeDtypeStruct((codes.shape[0], n), jnp.float32))(
        flat(codes), flat(scale), flat(offset)
    )
    return w.reshape(codes.shape)


def use_qgemm(x) -> bool:
    """Whether a product of ``x [M, K]`` with a block-quantized weight goes to the native kernel: the trace allows
    native products, 1 <= M <= QGEMM_MAX_ROWS, x float32, and the kernel is built."""
    return (
        _products.get() and x.ndim == 2 and 1 <= x.shape[0] <= QGEMM_MAX_ROWS and x.dtype == "float32"
        and loaded("qgemm")
    )  # fmt: skip


def qgemm(x, codes, scale, offset):
    """x [M, K] f32 @ dequant(codes [K, *out] int8, scale and offset [K/G, *out] f32) -> [M, *out] float32."""
    import jax
    import jax.numpy as jnp

    out = codes.shape[1:]
    n = math.prod(out)
    flat = lambda a: a.reshape(a.shape[0], n)  # noqa: E731
    y = jax.ffi.ffi_call("jaxserve_cpu_qgemm", jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
        x, flat(codes), flat(scale), flat(offset)
    )
    return y.reshape(x.shape[0], *out)


def qgemm_t(x, codes, scale, offset):
    """x [M, K] f32 against a quantized table (codes [N, K] int8, scale and offset [N, K/G]) -> [M, N] float32."""
    import jax
    import jax.numpy as jnp

    return jax.ffi.ffi_call("jaxserve_cpu_qgemm_t", jax.ShapeDtypeStruct((x.shape[0], codes.shape[0]), jnp.float32))(
        x, codes, scale, offset
    )

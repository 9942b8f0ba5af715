"""`jaxserve bench load`: how long the engine's load phase takes (its ``load_s``), per checkpoint format,
next to how fast the disk reads the same files.

    python -m jaxserve.bench.model_shapes llama3-8b /tmp/l8b --no-tokenizer
    jaxserve bench load --model /tmp/l8b --load-format dummy --convert-to /tmp/ckpt --cold --output-json load.json

Loads MODEL as the engine does (``load_model`` into the mesh's shardings, waited on), then, with
--convert-to DIR, converts it once (``jaxserve convert``, skipped when DIR already holds a checkpoint) and
loads DIR the same way. Each load runs --repeats times in this process (the first is what a fresh start
pays; later ones reuse this process's compiled converters). The disk's own rate is one buffered read of
the same files, cold (--cold: each file's pages are first dropped from the page cache with
posix_fadvise(DONTNEED), which touches no other file) and warm. --cold also drops them before every load.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import time


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser(
        "load", help="load time (the engine's load_s) per format, with GB/s and the disk's read rate"
    )
    p.add_argument("--convert-to", "--convert_to", dest="convert_to", default=None,
                   help="also convert MODEL into this directory (once) and time loading it")
    p.add_argument("--repeats", type=int, default=3, help="loads of each checkpoint in this process")
    p.add_argument("--cold", action="store_true",
                   help="drop the checkpoint files' pages from the page cache before each load and the cold read")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def checkpoint_files(path: str, fmt: str) -> list[str]:
    """The files a load of ``path`` reads (none for dummy weights)."""
    if fmt == "dummy":
        return []
    if fmt == "gguf":
        return [path]
    if fmt == "safetensors":
        return sorted(glob.glob(os.path.join(path, "*.safetensors")))
    from jaxserve.models.loader.orbax_format import read_metadata

    return [os.path.join(path, rel) for rel in read_metadata(path)["files"]]


def drop_from_page_cache(files: list[str]) -> None:
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty (just written) pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(files: list[str]) -> tuple[float, float]:
    """(GB read, GB/s) of one sequential buffered read of ``files``."""
    total, t0 = 0, time.perf_counter()
    buf = bytearray(16 * 2**20)
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    dt = time.perf_counter() - t0
    return total / 1e9, total / 1e9 / max(dt, 1e-9)


def time_loads(path: str, fmt: str, args, repeats: int, cold: bool) -> list[float]:
    """Seconds of each of ``repeats`` loads, each as build_engine_components runs it (its load_s)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve import sharding
    from jaxserve.engine_setup import current_platform, serving_dtype
    from jaxserve.model_loader import load_model
    from jaxserve.pallas_kernels.attention import get_attention_fn, resolve_backend

    platform_name = current_platform()
    mesh = sharding.replica_meshes(sharding.make_mesh(args.tensor_parallel_size))[0]
    attention_fn = get_attention_fn(
        resolve_backend(args.attention_backend, platform_name), platform_name, args.tensor_parallel_size
    )
    dtype = jnp.dtype(serving_dtype(args.dtype, platform_name))
    files = checkpoint_files(path, fmt)
    times = []
    for _ in range(repeats):
        if cold:
            drop_from_page_cache(files)
        t0 = time.perf_counter()
        model, _ = load_model(path, fmt, dtype=dtype, attention_fn=attention_fn, seed=args.seed,
                              shardings_fn=sharding.shardings_fn(mesh))  # fmt: skip
        jax.block_until_ready(nnx.state(model))
        times.append(time.perf_counter() - t0)
        del model
    return times


def run(ns: argparse.Namespace) -> int:
    import jax

    from jaxserve.cli import engine_args_from
    from jaxserve.convert import convert
    from jaxserve.engine_setup import current_platform, serving_dtype
    from jaxserve.model_loader import resolve_model_path
    from jaxserve.models.loader.orbax_format import is_orbax_checkpoint

    if ns.repeats < 1:
        raise ValueError(f"--repeats={ns.repeats} is invalid: must be >= 1")
    args = engine_args_from(ns)
    args.validate()
    targets = [(args.model, args.load_format)]
    result: dict = {
        "device": jax.devices()[0].device_kind, "platform": current_platform(), "jax": jax.__version__,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
        "dtype": serving_dtype(args.dtype, current_platform()), "tensor_parallel_size": args.tensor_parallel_size,
        "loads": [],
    }  # fmt: skip
    if ns.convert_to:
        if is_orbax_checkpoint(ns.convert_to):
            print(f"{ns.convert_to} already holds a checkpoint: not converting again")
        else:
            meta = convert(args.model, ns.convert_to, dtype=args.dtype, load_format=args.load_format, seed=args.seed)
            result["convert_s"] = meta["seconds"]
            print(f"converted to {ns.convert_to} in {meta['seconds']:.1f}s ({meta['total_bytes'] / 1e9:.2f} GB)")
        targets.append((ns.convert_to, "orbax"))

    for model, load_format in targets:
        path, fmt = resolve_model_path(model, load_format)
        files = checkpoint_files(path, fmt)
        gb = sum(os.path.getsize(f) for f in files) / 1e9
        times = time_loads(path, fmt, args, ns.repeats, ns.cold)
        row = {"model": model, "format": fmt, "gb": gb, "load_s": times,
               "first_gb_per_s": gb / times[0] if gb else None}  # fmt: skip
        if files:
            if ns.cold:
                drop_from_page_cache(files)
            row["disk_cold_gb_per_s" if ns.cold else "disk_first_gb_per_s"] = read_rate(files)[1]
            row["disk_warm_gb_per_s"] = read_rate(files)[1]
        result["loads"].append(row)
        disk = ", ".join(f"{k[5:-9]} read {v:.2f} GB/s" for k, v in row.items() if k.startswith("disk_"))
        rate = f" = {row['first_gb_per_s']:.2f} GB/s" if gb else ""
        print(f"{fmt:12s} {gb:7.2f} GB  load_s {', '.join(f'{t:.2f}' for t in times)} (first{rate})"
              + (f"; disk: {disk}" if disk else ""))  # fmt: skip
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

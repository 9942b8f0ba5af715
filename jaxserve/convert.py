"""`jaxserve convert MODEL OUT_DIR`: write any model jaxserve loads as a directory that starts fast.

The model goes through the normal loaders (HF safetensors, GGUF, dummy weights, the embedded default, or
another converted directory) in the serving dtype; OUT_DIR gets the weights as an orbax-checkpoint, an
HF-style config.json, the tokenizer and a metadata file (layout: jaxserve.models.loader.orbax_format).
Serving OUT_DIR then restores the arrays as stored: no dequantizing, transposing or casting.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Optional

logger = logging.getLogger("jaxserve")

_GENERATION_CONFIG = "generation_config.json"


def convert(
    model: Optional[str], out_dir: str, *, dtype: str = "auto", load_format: str = "auto", seed: int = 0
) -> dict[str, Any]:
    """Convert ``model`` into ``out_dir`` (which must not exist or be empty); returns the written metadata
    plus ``"seconds"`` (load + write)."""
    import jax.numpy as jnp

    from jaxserve.config import DTYPES, LOAD_FORMATS
    from jaxserve.engine_setup import current_platform, serving_dtype
    from jaxserve.model_loader import load_model, load_tokenizer, resolve_model_path
    from jaxserve.models.config import TextModelConfig
    from jaxserve.models.loader.hf import read_hf_config
    from jaxserve.models.loader.kv_scales import model_kv_scales
    from jaxserve.models.loader.orbax_format import write_metadata
    from jaxserve.models.loader.orbax_weights import save_weights
    from jaxserve.pallas_kernels.attention import get_attention_fn

    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is invalid: choose one of {DTYPES}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format={load_format!r} is invalid: choose one of {LOAD_FORMATS}")
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"OUT_DIR {out_dir!r} already exists and is not empty; name a new directory or delete it")
    t0 = time.perf_counter()
    path, fmt = resolve_model_path(model, load_format)
    resolved = serving_dtype(dtype, current_platform())
    hf_config, generation_config = _hf_config(path)
    source_cfg = TextModelConfig.from_hf_config(hf_config)
    tokenizer = _tokenizer(path, fmt, load_tokenizer)  # before the weights: a missing tokenizer fails fast

    # The attention function is not part of the weights; the plain reference one builds the same tree.
    loaded, _ = load_model(
        path, fmt, dtype=jnp.dtype(resolved), attention_fn=get_attention_fn("reference", current_platform()), seed=seed,
    )  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    params = save_weights(loaded, out_dir)
    kv_scales = model_kv_scales(loaded)  # fp8 KV cache scales: not arrays, so they go into the metadata
    del loaded
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if generation_config is not None:
        shutil.copyfile(generation_config, os.path.join(out_dir, _GENERATION_CONFIG))
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    written = read_hf_config(out_dir)
    want = read_hf_config(path) if os.path.isdir(path) else source_cfg
    if written != want:  # a config.json that reads back differently would build another model
        raise RuntimeError(f"the config.json written to {out_dir!r} reads back as {written}, not {want}")
    meta = write_metadata(
        out_dir, dtype=resolved, params=params, tokenizer=tokenizer is not None, kv_scales=kv_scales,
        source={"model": model, "path": os.path.abspath(path), "format": fmt, "seed": seed if fmt == "dummy" else None},
    )  # fmt: skip
    return {**meta, "seconds": time.perf_counter() - t0}


def _hf_config(path: str) -> tuple[dict[str, Any], Optional[str]]:
    """The config.json dict of the source (a GGUF file's is built from its metadata), and the path of its
    generation_config.json if it has one."""
    if path.endswith(".gguf"):
        from jaxserve.models.loader.gguf import read_gguf

        return dict(read_gguf(path).hf_config), None
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    gen = os.path.join(path, _GENERATION_CONFIG)
    return config, gen if os.path.isfile(gen) else None


def _tokenizer(path: str, fmt: str, load_tokenizer):
    try:
        return load_tokenizer(path)
    except ValueError:
        if fmt != "dummy":
            raise
        logger.warning("no tokenizer beside %s: the converted model will take token-id prompts only", path)
        return None


def add_parser(subparsers) -> argparse.ArgumentParser:
    from jaxserve.config import DTYPES, LOAD_FORMATS

    p = subparsers.add_parser(
        "convert",
        help="write a model as an orbax checkpoint directory that loads fast (serve it with `jaxserve serve OUT_DIR`)",
        description="Load MODEL (HF directory, .gguf file, a config directory with --load-format dummy, or nothing "
        "for the embedded default) in the serving dtype and write OUT_DIR: orbax weights, config.json, tokenizer.",
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="what to convert (default: the embedded default model)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the stored dtype; auto: what the engine serves in on this machine (float32 on CPU, "
                   "bfloat16 on GPU/TPU). Serving in another dtype casts while loading")
    p.add_argument("--load-format", "--load_format", dest="load_format", default="auto", choices=LOAD_FORMATS,
                   help="how to read MODEL (dummy: random weights from its config)")
    p.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    p.set_defaults(func=_cmd_convert)
    return p


def _cmd_convert(ns: argparse.Namespace) -> int:
    from jaxserve.engine_setup import current_platform

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    meta = convert(ns.model, ns.out_dir, dtype=ns.dtype, load_format=ns.load_format, seed=ns.seed)
    how = f"auto on {current_platform()}" if ns.dtype == "auto" else "as asked"
    src = meta["source"]
    print(
        f"converted {src['model'] or 'the default model'} ({src['format']}) to {os.path.abspath(ns.out_dir)} in "
        f"{meta['seconds']:.1f}s: {len(meta['params'])} arrays, {meta['total_bytes'] / 1e9:.3f} GB, dtype "
        f"{meta['dtype']} ({how}), tokenizer {'saved' if meta['tokenizer'] else 'none (token-id prompts only)'}.\n"
        f"serve it with: jaxserve serve {ns.out_dir}",
        file=sys.stderr,
    )
    return 0

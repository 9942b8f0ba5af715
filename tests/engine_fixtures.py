"""Shared helpers for engine tests: tiny checkpoints built once per session, small engines over them."""

from __future__ import annotations

import functools
import os
import tempfile

import jax

from tiny_models import VARIANTS, make_tiny_checkpoint

_ROOT = tempfile.mkdtemp(prefix="jaxserve-tiny-")


@functools.lru_cache(maxsize=None)
def checkpoint(variant: str) -> str:
    arch, overrides = VARIANTS[variant]
    path = os.path.join(_ROOT, variant)
    make_tiny_checkpoint(path, arch, **overrides)
    return path


def small_engine_kwargs(**overrides):
    """fp32, short context, tiny budget (forces chunked prefill), small blocks."""
    kw = dict(
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        block_size=4,
        compilation_cache_dir="",
        use_tqdm_on_load=False,
    )
    kw.update(overrides)
    if jax.default_backend() != "cpu" and "num_gpu_blocks_override" not in kw:
        # On a GPU a cache is sized from free device memory (0.9 of it), so the second engine a test builds
        # in one process would find none left: size it as on CPU (every sequence at full length, + null block).
        kw["num_gpu_blocks_override"] = kw["max_num_seqs"] * -(-kw["max_model_len"] // kw["block_size"]) + 1
    return kw

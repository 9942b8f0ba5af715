"""The on-disk contract of a converted checkpoint (``jaxserve convert``), and its checks; no JAX here.

Layout of a converted directory::

    OUT_DIR/config.json              HF-style, read by read_hf_config like any HF directory
    OUT_DIR/generation_config.json   when the source had one
    OUT_DIR/tokenizer*.json ...      transformers' save_pretrained (absent for a config-only dummy source)
    OUT_DIR/weights/                 orbax PyTree checkpoint (jaxserve.models.loader.orbax_weights)
    OUT_DIR/jaxserve_checkpoint.json written last: format version, dtype, parameters, weight files, and
                                     the fp8 KV cache scales ("kv_scales": {"layer": [k, v]}, only those
                                     not 1.0; optional, so older checkpoints read as all 1.0)

Checks before any array is read: the metadata file exists and has a format version this code knows,
config.json builds a model whose parameter names and shapes equal the recorded ones, and every weight
file recorded at conversion is present with its size. Each error names the path and says to re-run
``jaxserve convert``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

METADATA_FILE = "jaxserve_checkpoint.json"
WEIGHTS_DIR = "weights"
FORMAT_NAME = "jaxserve-orbax"
# 1: nested-dict state tree under weights/, zarr2 chunks without compression (written by PyTreeCheckpointer).
# 2: q/k/v and gate/up saved fused (qkv_proj [D, K, G+2, Dh], gate_up_proj [D, 2, F]), as the model runs them.
FORMAT_VERSION = 2

RECONVERT = "re-run `jaxserve convert SOURCE {path}` to rebuild it"


class CheckpointError(ValueError):
    """A converted checkpoint that cannot be loaded; the message names the path and the fix."""


def is_orbax_checkpoint(path: str) -> bool:
    """Whether ``path`` is (or was meant to be) a converted directory: its metadata or weights folder exists."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, METADATA_FILE)) or os.path.isdir(os.path.join(path, WEIGHTS_DIR))
    )


def weight_files(out_dir: str) -> dict[str, int]:
    """Every file under ``out_dir/weights`` (relative path -> size in bytes), to find a partial copy later."""
    root = os.path.join(out_dir, WEIGHTS_DIR)
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder, name)
            files[os.path.relpath(full, out_dir)] = os.path.getsize(full)
    return dict(sorted(files.items()))


def write_metadata(
    out_dir: str, *, dtype: str, params: dict[str, dict], source: dict[str, Any], tokenizer: bool,
    kv_scales: dict[int, tuple[float, float]] | None = None,
) -> dict:
    """Write ``jaxserve_checkpoint.json`` (last, so its presence means the conversion finished)."""
    from jaxserve import __version__

    files = weight_files(out_dir)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "jaxserve_version": __version__,
        "orbax_checkpoint_version": _orbax_version(),
        "dtype": dtype,
        "source": source,
        "tokenizer": tokenizer,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_bytes": sum(files.values()),
        "params": params,
        "files": files,
        "kv_scales": {str(layer): list(kv) for layer, kv in sorted((kv_scales or {}).items())},
    }
    tmp = os.path.join(out_dir, METADATA_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, METADATA_FILE))
    return meta


# ------------------------------------------------------------------ reading


def read_metadata(path: str) -> dict:
    """The checked metadata of a converted directory (format and version known, weights present)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist; {RECONVERT.format(path=path)}")
    meta_path = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{path!r} has no {METADATA_FILE}, so it is not a complete jaxserve checkpoint (a conversion that "
            f"did not finish leaves it out); {RECONVERT.format(path=path)}"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path!r} is not readable JSON ({e}); {RECONVERT.format(path=path)}") from e
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT_NAME:
        raise CheckpointError(
            f"{meta_path!r} does not describe a {FORMAT_NAME} checkpoint (format={found!r}); "
            f"{RECONVERT.format(path=path)}"
        )
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} was written in checkpoint format version {version!r} (by jaxserve "
            f"{meta.get('jaxserve_version')}), but this jaxserve reads versions up to {FORMAT_VERSION}: upgrade "
            f"jaxserve, or {RECONVERT.format(path=path)} with this version"
        )
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} was written in checkpoint format version {version} (by jaxserve {meta.get('jaxserve_version')}), "
            f"whose parameter layout this jaxserve no longer runs (it fuses q/k/v and gate/up into single matmuls); "
            f"{RECONVERT.format(path=path)}"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path!r} has no config.json (the model's shape); {RECONVERT.format(path=path)}")
    if not os.path.isdir(os.path.join(path, WEIGHTS_DIR)):
        raise CheckpointError(f"{path!r} has no {WEIGHTS_DIR}/ folder (the weights); {RECONVERT.format(path=path)}")
    return meta


def kv_scales_of(meta: dict) -> dict[int, tuple[float, float]]:
    """The fp8 KV cache scales recorded at conversion (layer -> (k, v)); none in older checkpoints."""
    return {int(layer): (float(k), float(v)) for layer, (k, v) in meta.get("kv_scales", {}).items()}


def has_tokenizer(path: str) -> bool:
    """Whether the conversion saved a tokenizer (a config-only dummy source has none)."""
    try:
        return bool(read_metadata(path).get("tokenizer", True))
    except CheckpointError:
        return True


def check_params(path: str, meta: dict, expected: dict[str, tuple[int, ...]]) -> None:
    """The model config.json builds must have exactly the recorded parameters, with the recorded shapes."""
    recorded = {name: tuple(p["shape"]) for name, p in meta["params"].items()}
    missing = sorted(set(expected) - set(recorded))
    extra = sorted(set(recorded) - set(expected))
    shapes = [f"{n}: config gives {expected[n]}, weights have {recorded[n]}"
              for n in sorted(set(expected) & set(recorded)) if expected[n] != recorded[n]]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"parameters the config needs but the weights lack: {_clip(missing)}")
    if extra:
        problems.append(f"saved parameters the config has no place for: {_clip(extra)}")
    if shapes:
        problems.append(f"shape mismatches: {_clip(shapes)}")
    if problems:
        raise CheckpointError(
            f"{os.path.join(path, 'config.json')!r} does not match the saved weights in {path!r} (was config.json "
            f"edited, or copied from another model?): " + "; ".join(problems) + f"; {RECONVERT.format(path=path)}"
        )


def check_files(path: str, meta: dict) -> None:
    """Every weight file the conversion wrote is still there, at its size (a partial copy fails here)."""
    missing, resized = [], []
    for rel, size in meta.get("files", {}).items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            missing.append(rel)
        elif os.path.getsize(full) != size:
            resized.append(f"{rel} ({os.path.getsize(full)} bytes, written as {size})")
    if missing or resized:
        parts = ([f"missing files {_clip(missing)}"] if missing else []) + (
            [f"changed sizes {_clip(resized)}"] if resized else []
        )
        what = "; ".join(parts)
        raise CheckpointError(
            f"the weights in {path!r} are incomplete or corrupt: {what}; {RECONVERT.format(path=path)}"
        )


def _orbax_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orbax-checkpoint")
    except PackageNotFoundError:
        return "unknown"


def _clip(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"


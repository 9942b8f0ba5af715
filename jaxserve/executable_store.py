"""Compiled step programs kept on disk, so that a warm start skips tracing and lowering the model.

JAX's persistent compilation cache saves the XLA compile, but it is looked up by a hash of the lowered
program, so every start still traces and lowers each step shape first: on an H200, for the 32 layers of an
8B model, ~1.6 s of Python per shape (13 s of a 21 s warm start). This store is looked up *before*
tracing, by a fingerprint of everything that decides the program: JAX and jaxlib versions, the devices,
XLA flags, jaxserve's own source code, and a description of the step (model config, dtype, shapes,
shardings) that the runner passes in. Anything else that changed would change one of those.

Accelerators only: on XLA:CPU (jaxlib 0.10) a deserialized executable fails at run time
("Function wrapped_iota not found"), so the CPU relies on JAX's cache alone. Any failure to read or
load an entry is logged and the program is compiled as usual; entries are written atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
from typing import Any, Optional

import jax

logger = logging.getLogger("jaxserve")

_FORMAT = 1  # bump when the entry layout changes


class ExecutableStore:
    """A directory of serialized ``jax.stages.Compiled`` programs, one file per (fingerprint, name)."""

    def __init__(self, root: str, context: dict[str, Any]) -> None:
        self.root = root
        self.fingerprint = _digest({"format": _FORMAT, "environment": _environment(), "context": context})
        self.hits = 0
        self.misses = 0

    @classmethod
    def open(cls, cache_dir: Optional[str], platform: str, context: dict[str, Any]) -> Optional["ExecutableStore"]:
        """The store under ``cache_dir/executables``, or None where it does not apply (no cache dir, CPU)."""
        if not cache_dir or platform == "cpu":
            return None
        try:
            from jax.experimental import serialize_executable  # noqa: F401
        except ImportError:
            return None
        if platform == "gpu":
            _load_mosaic_gpu_runtime()
        root = os.path.join(cache_dir, "executables")
        os.makedirs(root, exist_ok=True)
        return cls(root, context)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, f"{name}-{_digest([self.fingerprint, name])[:32]}.jxe")

    def load(self, name: str, devices: list):
        """The stored program ``name`` on ``devices`` (those it was compiled for, in its device-assignment
        order), or None (not stored yet, or unreadable: then it is recompiled)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(name)
        if not os.path.exists(path):
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - a bad entry must never stop a start-up
            logger.warning("could not load the stored program %s (%s: %s); compiling it again", path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def save(self, name: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        path = self._path(name)
        try:
            data = pickle.dumps(serialize(compiled))
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the whole entry or none
        except Exception as e:  # noqa: BLE001 - the store is an optimisation only
            logger.warning("could not store the compiled program %s (%s: %s)", path, type(e).__name__, e)


def _load_mosaic_gpu_runtime() -> None:
    """A program with Mosaic GPU kernels (the Pallas prefill) finds their runtime library through an
    environment variable that importing jax.experimental.mosaic.gpu sets. A traced start imports it while
    tracing the kernels; a start that only loads programs must import it itself."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401
    except ImportError:
        pass


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """A hash of every Python file of jaxserve (engine, models, kernels): a code change is a new program."""
    import jaxserve
    import jaxserve.models
    import jaxserve.pallas_kernels

    h = hashlib.sha256()
    for package in (jaxserve, jaxserve.models, jaxserve.pallas_kernels):
        for directory in package.__path__:
            for dirpath, dirnames, filenames in os.walk(directory):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(".py"):
                        with open(os.path.join(dirpath, name), "rb") as f:
                            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _environment() -> dict[str, Any]:
    import jaxlib

    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform_version": devices[0].client.platform_version,
        "devices": [d.device_kind for d in devices],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "source": _source_digest(),
    }

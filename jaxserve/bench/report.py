"""What every offline bench's JSON result records besides its numbers: the engine as built, and where it ran."""

from __future__ import annotations

import dataclasses
import json
import platform
import time


def run_fields(engine, args) -> dict:
    """engine_info, engine_args, device, jax, python and date of a run (a data-parallel router has not started
    JAX on the devices, its replicas hold them: the device kind comes from the engine's info first)."""
    import jax

    info = engine.info()
    return {
        "engine_info": info,
        "engine_args": dataclasses.asdict(args),
        "device": info.get("device_kind") or str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

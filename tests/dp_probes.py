"""Functions that tests run inside data-parallel replicas' processes (``DPEngine.collective_rpc``): they
travel by name, so they live in this module, which the replicas can import."""

from __future__ import annotations

import os
import time


def replica_view(engine) -> dict:
    """What a replica sees: its devices and how its KV cache is sharded over them."""
    import jax

    return {"num_devices": len(jax.devices()), "mesh_shape": dict(engine.runner.mesh.shape),
            "kv_spec": tuple(engine.runner.kv_caches[0][0].sharding.spec),
            "cores": len(os.sched_getaffinity(0))}


def set_step_delay(engine, seconds: float) -> None:
    """Make each step take at least ``seconds`` (0: undo), so a long request surely outlives a client."""
    step = getattr(engine, "_undelayed_step", engine.step)
    engine._undelayed_step = step
    engine.step = (lambda: time.sleep(seconds) or step()) if seconds else step


def fail_steps(engine, message: str) -> None:
    """Make the replica's next step raise."""

    def failing():
        raise RuntimeError(message)

    engine.step = failing


def hard_exit(engine, code: int) -> None:
    """End the replica's process at once, as a crash in native code or the OOM killer would."""
    os._exit(code)

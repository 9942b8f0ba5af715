"""The router's side of one data-parallel replica: which devices it gets, its process, its pipes.

Devices. Replica i gets devices ``[i*tp, (i+1)*tp)`` of the machine, as rows of the ``(data, model)`` mesh
did when replicas were threads. A replica process must see only its own devices, and that has to be set
before JAX starts in it: on GPUs through CUDA_VISIBLE_DEVICES (each replica then numbers its GPUs from 0),
on the CPU by giving it ``tp`` host devices and, when there are enough cores, its own share of them, so
replicas do not fight over cores. TPUs are not split between processes yet.

The router never initialises an accelerator itself (JAX would take most of its memory for a process that
runs no model): it counts devices in a short-lived interpreter, except when JAX is restricted to the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Optional

from jaxserve.engine_core_proc import Sender, receive

logger = logging.getLogger("jaxserve")

_PROBE = "import jax, json; d = jax.devices(); print(json.dumps([d[0].platform, len(d)]))"


class EngineCoreError(RuntimeError):
    """A data-parallel replica's process failed or died; the engine cannot go on."""


def visible_devices() -> tuple[str, int]:
    """(platform, device count) as JAX in a fresh process on this machine sees them."""
    import jax

    if (jax.config.jax_platforms or "").split(",")[0] == "cpu":
        return "cpu", len(jax.devices())  # the CPU backend costs nothing to start
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not list this machine's JAX devices:\n{proc.stderr[-2000:]}")
    platform, count = json.loads(proc.stdout.strip().splitlines()[-1])
    return platform, count


def replica_environments(platform: str, tp: int, dp: int) -> list[tuple[list[int], dict[str, str], list[int]]]:
    """Per replica: its device ids (as the router numbers them), its environment, its CPU cores ([]: all)."""
    if platform == "tpu":
        raise ValueError(
            f"data_parallel_size={dp} is not supported on TPU yet: replicas run in processes of their own, and "
            "jaxserve does not split TPU chips between processes; use tensor_parallel_size, or run one jaxserve "
            "per group of chips behind a load balancer"
        )
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // dp
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    plans = []
    for i in range(dp):
        ids = list(range(i * tp, (i + 1) * tp))
        env = dict(os.environ)
        if platform == "cpu":
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={tp}".strip()
            cpus = cores[i * per : (i + 1) * per] if per else []
        else:  # GPUs: each replica sees its own, numbered from 0 inside it
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[j] if visible else str(j) for j in ids)
            cpus = []
        plans.append((ids, env, cpus))
    return plans


class EngineCoreClient:
    """One replica's process (``python -m jaxserve.engine_core_proc``) and the two pipes to it.

    A fresh interpreter rather than ``fork``: forking a process that has started JAX is unsafe. It is started
    with ``subprocess`` rather than ``multiprocessing``'s spawn so that its environment (devices) is its own
    and the user's ``__main__`` is not re-run in it.
    """

    def __init__(self, index: int, device_ids: list[int], env: dict[str, str], cpus: list[int], init: dict) -> None:
        self.index = index
        self.device_ids = device_ids
        self.stats: Any = None  # the replica's EngineStats after its last step (get_stats)
        self.ready: Optional[dict] = None  # the "ready" message's payload
        self.error: Optional[EngineCoreError] = None  # set once the replica has failed
        self.adds_sent = 0  # requests sent to the replica ...
        self.adds_seen = 0  # ... and how many of them it had taken in at its last stats
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        argv = [sys.executable, "-m", "jaxserve.engine_core_proc", str(cmd_r), str(out_w)]
        if cpus:
            argv += ["--cpus", ",".join(map(str, cpus))]
        try:
            self.proc = subprocess.Popen(argv, env=env, pass_fds=(cmd_r, out_w))
        finally:
            os.close(cmd_r)  # the child's ends: closed here so that EOF reaches each side when the other dies
            os.close(out_w)
        self.conn = Connection(out_r, writable=False)
        self._sender = Sender(Connection(cmd_w, readable=False), f"jaxserve-dp{index}-sender")
        self.send(("init", {**init, "index": index, "send_tokenizer": index == 0}))

    def send(self, message: tuple) -> None:
        self._sender.send(message)

    def get_stats(self):
        """The replica's EngineStats after its last step, counting requests still on their way as waiting."""
        in_transit = self.adds_sent - self.adds_seen
        return dataclasses.replace(self.stats, num_waiting=self.stats.num_waiting + in_transit) if in_transit \
            else self.stats

    def take_stats(self, stats, adds_seen: int) -> None:
        self.stats, self.adds_seen = stats, adds_seen

    def receive_all(self) -> list[tuple]:
        """Every message that has arrived; raises EngineCoreError if the replica failed or died (again on
        every later call: the caller may try to clean up, e.g. abort, after the first)."""
        if self.error is not None:
            raise self.error
        messages = []
        while True:
            try:
                if not self.conn.poll():
                    return messages
                msg = receive(self.conn)
            except (EOFError, OSError):
                try:
                    code = self.proc.wait(30)  # its pipe closes as it exits
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    code = self.proc.wait()
                self.error = EngineCoreError(
                    f"data-parallel replica {self.index} (pid {self.proc.pid}) exited with code {code} "
                    "without reporting an error (killed, out of memory, or crashed in native code?)"
                )
                raise self.error from None
            if msg[0] == "error":
                _, cause, text = msg
                where = f"data-parallel replica {self.index} (pid {self.proc.pid})"
                self.error = EngineCoreError(f"{where} failed:\n{text}")
                raise self.error from cause
            messages.append(msg)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, and end it if it does not."""
        if self.proc.poll() is None:
            self.send(("stop",))
        self._sender.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

"""How XLA:GPU launches a compiled program's kernels: recorded into one command buffer (a CUDA graph) or one by one.

XLA:GPU records a program's kernels into a command buffer and, whenever an argument's address differs from the
last call's (every step: its inputs are fresh arrays), records it again before launching it. On the H200 that
re-record cost the host about 2 ms per Llama-3-8B step, and the device's first kernel waits for it
(docs/BENCHMARKS.md, session 13). A plain decode step hides those 2 ms: the host records and launches step N+1
while step N runs. A speculative verify step cannot: its launch waits for the previous step's accepted tokens,
so the re-record landed on every step's critical path (EAGLE-1 at acceptance 3: 8.85 ms a step with command
buffers, 6.97 ms without). Launched one by one, the kernels start as the host issues them, and the host keeps
ahead of the device.

So the policy (``JAXSERVE_COMMAND_BUFFERS``):

- ``auto`` (default): programs whose launch waits on the host launch kernel by kernel: verify steps, EAGLE
  rounds, and every plain step of a speculative engine (its loop runs one step at a time; measured on EAGLE-1:
  7.61 ms a step with those steps recorded, 6.98 ms without). The rest keep command buffers: plain steps of the
  asynchronous loop (hidden, as above) and the draft model's rounds, whose four passes of a whole model are ~800
  small kernels that the host issues slower than the device runs them (11.2 ms a step one by one, 10.2 ms
  recorded).
- ``always``: every program in command buffers (XLA's default, jaxserve's before session 13).
- ``never``: no program in command buffers.

Other platforms have no command buffers: nothing changes there.
"""

from __future__ import annotations

import os

MODES = ("auto", "always", "never")
_NO_COMMAND_BUFFER = {"xla_gpu_enable_command_buffer": ""}  # XLA's flag: the command types to record; none


def env_mode(variable: str) -> str:
    """A per-program XLA-option policy's mode, from the environment variable ``variable``: one of ``MODES``,
    "auto" when unset (also gemm_backend's)."""
    value = os.environ.get(variable, "auto")
    if value not in MODES:
        raise ValueError(f"{variable}={value!r} is not one of {', '.join(MODES)}")
    return value


def mode() -> str:
    return env_mode("JAXSERVE_COMMAND_BUFFERS")


def compiler_options(platform: str, host_bound: bool) -> dict | None:
    """XLA options for a program compiled for ``platform``; ``host_bound``: its launch waits on the host's
    reading of the step before it (see the module's docstring). None: XLA's defaults."""
    if platform != "gpu":
        return None
    m = mode()
    if m == "never" or (m == "auto" and host_bound):
        return dict(_NO_COMMAND_BUFFER)
    return None


def describe(options: dict | None) -> str:
    """A short tag for executable-store names: programs compiled with other options must not be loaded."""
    return "" if not options else "-nocb"

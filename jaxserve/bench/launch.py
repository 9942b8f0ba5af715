"""Run `jaxserve serve` in a child process for a benchmark: start it, wait until it answers, stop it.

The load generator then runs in the benchmark's own process, so the client's work (SSE parsing of every
token) never competes with the server's engine thread for one interpreter's GIL.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

from jaxserve.config import NOT_FLAGS, EngineArgs


def engine_flags(args: EngineArgs) -> list[str]:
    """The `jaxserve serve` flags that rebuild ``args`` (only fields that differ from the defaults)."""
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == f.default or f.name in NOT_FLAGS:
            continue
        name = f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            flags.append(name if value else f"--no-{f.name.replace('_', '-')}")
        elif value is not None:
            flags += [name, str(value)]
    return flags


class ServerProcess:
    """`jaxserve serve` on 127.0.0.1:port; its output goes to ``log_path``."""

    def __init__(self, args: EngineArgs, port: int, log_path: str, startup_timeout: float = 900.0) -> None:
        self.args, self.port, self.log_path, self.startup_timeout = args, port, log_path, startup_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def __enter__(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *engine_flags(self.args), "--host", "127.0.0.1",
               "--port", str(self.port), "--disable-access-log", "--uvicorn-log-level", "warning"]
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(t0)
        except BaseException:  # a failed start, a timeout, or SIGTERM / Ctrl-C while waiting: no orphan server
            self.__exit__()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        import httpx

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`jaxserve serve` exited with code {self.proc.returncode} during start-up: "
                                   f"{_tail(self.log_path)} (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > self.startup_timeout:
                raise TimeoutError(f"`jaxserve serve` did not answer /health within {self.startup_timeout:.0f}s "
                                   f"(log: {self.log_path})")
            time.sleep(1.0)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: in-flight requests finish, then exit 0
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None


def _tail(path: str, lines: int = 3) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return " | ".join(f.read().strip().splitlines()[-lines:])

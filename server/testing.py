"""Run a real server (uvicorn on loopback, a free port) in a background thread: for tests and notebooks.

>>> with ServerThread(AsyncLLMEngine.from_engine_args(EngineArgs(model=path))) as srv:
...     httpx.get(srv.url + "/health")
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn

from jaxserve.async_engine import AsyncLLMEngine

from jaxserve.server.api_server import ServerOptions, build_app, uvicorn_config


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving ``engine`` on 127.0.0.1 in a daemon thread; ``stop()`` shuts it down gracefully."""

    def __init__(
        self, engine: AsyncLLMEngine, api_key: Optional[str] = None, graceful_shutdown_timeout: float = 5.0, **app_kw
    ):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, api_key=api_key, **app_kw)  # app_kw: lora_modules, allow_runtime_lora_updating
        options = ServerOptions(
            host="127.0.0.1", port=self.port, api_key=api_key, log_level="warning", access_log=False,
            graceful_shutdown_timeout=graceful_shutdown_timeout,
        )
        self.server = uvicorn.Server(uvicorn_config(self.app, options))
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread = threading.Thread(target=self.server.run, name="jaxserve-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

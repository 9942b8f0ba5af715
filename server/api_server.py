"""The Starlette app (routes, auth, errors, lifespan) and the uvicorn server that runs it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import threading
from typing import Optional

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineArgs

from jaxserve.server.embeddings import runner_routes
from jaxserve.server.errors import EXCEPTION_HANDLERS, error_response
from jaxserve.server.metrics import ServerMetrics, metrics_endpoint
from jaxserve.server.openapi import openapi_endpoint
from jaxserve.server.routes_chat import create_chat_completion
from jaxserve.server.routes_responses import create_response, delete_response, retrieve_response
from jaxserve.server.routes_completions import create_completion
from jaxserve.server.routes_lora import (
    load_lora_adapter, register_lora_modules, runtime_lora_updating_from_env, unload_lora_adapter,
)  # fmt: skip
from jaxserve.server.routes_misc import detokenize, health, list_models, tokenize, version
from jaxserve.server.serving import ServerState
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The HTTP side's settings (the engine's are EngineArgs)."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: Optional[str] = None  # required as "Authorization: Bearer KEY" on /v1 routes
    max_waiting_requests: Optional[int] = None  # beyond it: 503 at once
    graceful_shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    log_level: str = "info"
    access_log: bool = True
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules name=path: adapters served under their names
    allow_runtime_lora_updating: Optional[bool] = None  # None: $JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING
    tool_call_parser: Optional[str] = None  # --enable-auto-tool-choice: how tool_choice="auto" reads calls
    default_chat_template_kwargs: Optional[dict] = None  # template variables every chat request gets
    enable_prompt_tokens_details: bool = False  # usage reports prompt_tokens_details.cached_tokens


class APIKeyMiddleware:
    """Every /v1 route needs ``Authorization: Bearer KEY``; others (health, metrics) stay open, as vLLM's."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                response = error_response(
                    401, "Invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLMEngine,
    api_key: Optional[str] = None,
    lora_modules: Optional[list[tuple[str, str]]] = None,
    allow_runtime_lora_updating: Optional[bool] = None,
    tool_call_parser: Optional[str] = None,
    default_chat_template_kwargs: Optional[dict] = None,
    enable_prompt_tokens_details: bool = False,
) -> Starlette:
    """The ASGI app over an engine. The lifespan starts the engine thread and stops it on shutdown.
    ``lora_modules``: (name, path) adapters served under their names; ``allow_runtime_lora_updating``: the
    load/unload routes (None: from $JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING); ``tool_call_parser``: the format
    tool_choice="auto" reads calls in (None: "auto" is refused); ``enable_prompt_tokens_details``: usage reports the
    prompt's cached tokens."""
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_updating_from_env()
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser={tool_call_parser} is invalid: choose one of {', '.join(TOOL_CALL_PARSERS)}")
    state = ServerState.for_engine(
        engine, api_key=api_key, allow_runtime_lora_updating=allow_runtime_lora_updating,
        tool_call_parser=tool_call_parser, default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
        enable_prompt_tokens_details=enable_prompt_tokens_details,
    )
    register_lora_modules(state, lora_modules or [])
    metrics = ServerMetrics(state.model_name)
    metrics.attach(engine)
    engine.observer = metrics

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"], include_in_schema=False),
    ]
    routes = runner_routes(getattr(engine.engine, "is_pooling", False), routes)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            # Requests still running here outlived the grace period: abort them and stop the thread.
            await asyncio.to_thread(engine.shutdown)

    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.jaxserve = state
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


class _Server(uvicorn.Server):
    """uvicorn, but a SIGTERM/SIGINT shutdown that went well exits 0.

    uvicorn re-raises the signal after its graceful shutdown, so the process would end "killed by
    SIGTERM"; a supervisor should instead see a clean exit.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for requests
            else:
                logger.info("received %s: finishing in-flight requests, accepting no new ones", signal.Signals(sig).name)
                self.should_exit = True

        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, on_signal) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_config(app: Starlette, options: ServerOptions) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        access_log=options.access_log,
        timeout_graceful_shutdown=max(1, int(round(options.graceful_shutdown_timeout))),
        timeout_keep_alive=5,
    )


def serve(engine_args: EngineArgs, options: ServerOptions) -> None:
    """Build the engine (loads and compiles: minutes for big models), then serve until a signal."""
    engine = AsyncLLMEngine.from_engine_args(engine_args, max_waiting_requests=options.max_waiting_requests)
    info = engine.engine.info()
    logger.info("engine ready: %s", info)
    app = build_app(
        engine, api_key=options.api_key, lora_modules=list(options.lora_modules),
        allow_runtime_lora_updating=options.allow_runtime_lora_updating, tool_call_parser=options.tool_call_parser,
        default_chat_template_kwargs=options.default_chat_template_kwargs,
        enable_prompt_tokens_details=options.enable_prompt_tokens_details,
    )
    server = _Server(uvicorn_config(app, options))
    shown_host = "127.0.0.1" if options.host in ("0.0.0.0", "") else options.host
    logger.info("serving %s at http://%s:%d/v1", info["model"], shown_host, options.port)
    server.run()

"""`jaxserve serve [MODEL] [engine flags] [server flags]`: the OpenAI-compatible server's command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Optional

from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS

_API_KEY_ENV = "JAXSERVE_API_KEY"


def add_serve_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    """Register `serve` on the `jaxserve` command's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...). "
        "Without MODEL it serves the embedded default (SmolLM2-135M-Instruct).",
    )
    add_engine_args(p, positional_model=True)
    g = p.add_argument_group("server options")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0, all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument(
        "--api-key", "--api_key", dest="api_key", default=os.environ.get(_API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${_API_KEY_ENV}, or no key)",
    )
    g.add_argument(
        "--max-waiting-requests", "--max_waiting_requests", dest="max_waiting_requests", type=int, default=None,
        help="answer 503 at once when this many requests are already waiting (default: no limit)",
    )
    g.add_argument(
        "--graceful-shutdown-timeout", "--graceful_shutdown_timeout", dest="graceful_shutdown_timeout",
        type=float, default=30.0,
        help="after SIGTERM, seconds in-flight requests get to finish before they are aborted (default: 30)",
    )
    g.add_argument(
        "--uvicorn-log-level", "--uvicorn_log_level", dest="uvicorn_log_level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level",
    )
    g.add_argument(
        "--disable-access-log", "--disable_access_log", dest="disable_access_log", action="store_true",
        help="don't log every HTTP request",
    )
    g.add_argument(
        "--lora-modules", "--lora_modules", dest="lora_modules", nargs="+", default=None, metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under their own model names; needs --enable-lora",
    )
    g.add_argument(
        "--allow-runtime-lora-updating", "--allow_runtime_lora_updating", dest="allow_runtime_lora_updating",
        action="store_true", default=None,
        help="turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
        "$JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING=1, else off)",
    )
    g.add_argument(
        "--enable-auto-tool-choice", "--enable_auto_tool_choice", dest="enable_auto_tool_choice",
        action="store_true",
        help='let tool_choice="auto" (the default with tools) read calls from the reply; needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser", "--tool_call_parser", dest="tool_call_parser", default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="the format the model writes calls in: hermes (<tool_call>{json}</tool_call>: Qwen2/2.5/3, Hermes) or "
        "llama3_json (Llama 3.1+ JSON calls)",
    )
    g.add_argument(
        "--default-chat-template-kwargs", "--default_chat_template_kwargs", dest="default_chat_template_kwargs",
        default=None, metavar="JSON",
        help='template variables for every chat request, as a JSON object (e.g. \'{"enable_thinking": false}\'); a '
        "request's chat_template_kwargs override them name by name",
    )
    g.add_argument(
        "--enable-prompt-tokens-details", "--enable_prompt_tokens_details", dest="enable_prompt_tokens_details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache) on "
        "completions and chat; the Responses API always reports them",
    )
    p.set_defaults(func=_cmd_serve)
    return p


def parse_template_kwargs(text: Optional[str]) -> dict:
    """--default-chat-template-kwargs: a JSON object, or a ValueError that shows one."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--default-chat-template-kwargs={text!r} is not valid JSON ({e}); pass an object such as "
                         '\'{"enable_thinking": false}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"--default-chat-template-kwargs={text!r} is invalid: it must be a JSON object, such as "
                         '\'{"enable_thinking": false}\'')
    return value


def _cmd_serve(ns: argparse.Namespace) -> int:
    from jaxserve.cli import engine_args_from
    from jaxserve.server.api_server import ServerOptions, serve
    from jaxserve.server.routes_lora import parse_lora_modules

    if ns.max_waiting_requests is not None and ns.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests={ns.max_waiting_requests} is invalid: must be >= 1 (or unset)")
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port={ns.port} is invalid: must be in 1..65535")
    if ns.graceful_shutdown_timeout < 0:
        raise ValueError(f"--graceful-shutdown-timeout={ns.graceful_shutdown_timeout} is invalid: must be >= 0")
    if ns.enable_auto_tool_choice != (ns.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: pass both to let "
                         'tool_choice="auto" read calls (e.g. --enable-auto-tool-choice --tool-call-parser hermes)')
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    options = ServerOptions(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or None,
        max_waiting_requests=ns.max_waiting_requests,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_access_log,
        lora_modules=tuple(parse_lora_modules(ns.lora_modules)),
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
        tool_call_parser=ns.tool_call_parser,
        default_chat_template_kwargs=parse_template_kwargs(ns.default_chat_template_kwargs),
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
    )
    args = engine_args_from(ns)
    if options.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (and --max-loras / --max-lora-rank to fit the adapters)")
    serve(args, options)
    return 0

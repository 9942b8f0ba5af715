"""LoRA adapters at run time: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes).

Off unless the server starts with ``--allow-runtime-lora-updating`` or ``JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING=1``
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): loading reads any directory the server can see. When off, both
routes answer 404 saying how to turn them on.
"""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from jaxserve.lora.request import LoRARequest

from jaxserve.server.errors import APIError, bad_request, from_value_error
from jaxserve.server.serving import ServerState, engine_error, get_state, parse_body

RUNTIME_LORA_ENV = "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_from_env() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules name=path [name=path ...]`` -> [(name, path)]; a bad entry names the flag."""
    out = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r} is invalid: write name=path (e.g. sql-lora=/adapters/sql)")
        out.append((name, path))
    return out


def _check_enabled(state: ServerState) -> None:
    if not state.allow_runtime_lora_updating:
        raise APIError(
            404,
            "Loading and unloading LoRA adapters at run time is off: start the server with "
            f"--allow-runtime-lora-updating or {RUNTIME_LORA_ENV}=1",
            code="not_found",
        )


async def load_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    _check_enabled(state)
    body = await parse_body(request, LoadLoRAAdapterRequest)
    if body.lora_name in state.lora_modules or body.lora_name in state.served_model_names:
        raise bad_request(f"The model `{body.lora_name}` is already served; unload it first", param="lora_name")
    lora = LoRARequest(body.lora_name, _next_id(state), body.lora_path)
    try:
        await state.engine.call_engine(lambda engine: engine.add_lora(lora))
    except ValueError as e:
        raise from_value_error(e) from None
    except Exception as e:  # noqa: BLE001
        raise engine_error(e) from e
    state.lora_modules[body.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    _check_enabled(state)
    body = await parse_body(request, UnloadLoRAAdapterRequest)
    lora = state.lora_modules.get(body.lora_name)
    if lora is None:
        raise APIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded", param="lora_name", code="model_not_found")
    try:
        await state.engine.call_engine(lambda engine: engine.remove_lora(lora.lora_int_id))
    except ValueError as e:
        raise from_value_error(e) from None
    del state.lora_modules[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _next_id(state: ServerState) -> int:
    state.next_lora_id += 1  # never reused: an id names one adapter for the engine's whole life
    return state.next_lora_id - 1


def register_lora_modules(state: ServerState, modules: list[tuple[str, str]]) -> None:
    """Read the ``--lora-modules`` adapters at start-up (before the engine thread runs); a bad one stops the start."""
    for name, path in modules:
        if name in state.lora_modules or name in state.served_model_names:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice (or is the base model's)")
        lora = LoRARequest(name, _next_id(state), path)
        state.engine.engine.add_lora(lora)
        state.lora_modules[name] = lora

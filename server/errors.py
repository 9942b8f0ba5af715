"""OpenAI-style errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

import pydantic
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger("jaxserve.server")

# OpenAI's error "type" for each status we answer with.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error the client sees as an OpenAI error body with this status."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(e: ValueError) -> APIError:
    """A 400 for the engine's own validation; its messages start "SamplingParams.field=value is invalid" (or
    "structured_outputs.kind does not compile")."""
    message = str(e)
    found = re.match(r"(?:SamplingParams\.)?([a-z_]+(?:\.[a-z_]+)?)(?:=| does not compile)", message)
    return bad_request(message, param=found.group(1) if found else None)


def from_validation_error(e: pydantic.ValidationError) -> APIError:
    """A 400 naming the first bad field (dotted path), what was wrong, and the value sent."""
    errors = e.errors(include_url=False)
    if not errors:
        return bad_request(str(e))
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Union members add their type names to the path ("prompt.str"); keep only the request's own names.
    param = ".".join(p for p in loc if not p.startswith(("list[", "function-", "str", "int", "float", "bool"))) or None
    value = first.get("input")
    shown = json.dumps(value, default=str)
    if len(shown) > 100:
        shown = shown[:100] + "..."
    message = f"{param or 'request'}: {first.get('msg', 'invalid value')} (got {shown})"
    if len(errors) > 1:
        message += f"; and {len(errors) - 1} more error(s)"
    return bad_request(message, param=param)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error")


EXCEPTION_HANDLERS = {
    APIError: api_error_handler,
    HTTPException: http_exception_handler,
    Exception: unhandled_error_handler,
}

"""Tool calls out of generated text: one parser per format a model is trained to write, and the two formats a
forced tool choice generates under its grammar.

A parser reads the whole text so far (a stream re-reads it at every delta; tool calls are short) and returns the
length of its plain-content prefix and the calls it holds so far. Two rules keep a stream and the final answer
the same: the content prefix only grows (text that may still turn into a call is held back, as a stop string is),
and a call is listed only once its JSON is complete, except a named tool choice's, whose whole output is the
arguments and so grows as a prefix of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object (a prefix of it while a named call streams)


@dataclasses.dataclass
class Parsed:
    content_end: int  # text[:content_end] is plain content
    calls: list[ParsedCall]


# (text so far, whether the text is final) -> Parsed
ToolParser = Callable[[str, bool], Parsed]


def _arguments_json(value) -> str:
    """Arguments as JSON text in json.dumps's style, the one a grammar-forced call is written in."""
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _as_call(obj, args_keys: tuple[str, ...]) -> Optional[ParsedCall]:
    """A decoded JSON value as a call when it is {"name": str, <one of args_keys>: object}; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], _arguments_json(args))


def _held_back(text: str, marker: str) -> int:
    """Where a partial ``marker`` at the end of ``text`` starts (len(text) when none): that tail may still
    become the marker, so it is not content yet."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


# ---------------------------------------------------------------- hermes: <tool_call>{json}</tool_call>

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> Parsed:
    """Hermes-style calls (Qwen2/2.5/3, Hermes, and most chat templates with tools): each call is
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Content is the text before the first call;
    when the final text holds no valid call, all of it is content."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return Parsed(len(text) if final else _held_back(text, _HERMES_OPEN), [])
    calls: list[ParsedCall] = []
    pos = start
    while pos >= 0:
        body_start = pos + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_start)
        if end < 0 and not final:
            break  # still being written
        body = text[body_start : end if end >= 0 else len(text)]
        try:
            call = _as_call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            break  # not a call we can read: stop here, keep what came before
        calls.append(call)
        pos = text.find(_HERMES_OPEN, end + len(_HERMES_CLOSE)) if end >= 0 else -1
    if final and not calls:
        return Parsed(len(text), [])
    return Parsed(start, calls)


# ---------------------------------------------------------------- llama3_json: {"name": ..., "parameters": ...}

_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> Parsed:
    """Llama 3.1+ JSON calls: the reply starts (after an optional ``<|python_tag|>``) with
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``. A reply that starts with anything else is
    content."""
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG) :]
        lead = len(text) - len(stripped.lstrip())
        stripped = stripped.lstrip()
    elif not final and _PYTHON_TAG.startswith(stripped):
        return Parsed(0, [])  # only whitespace, or the tag's start: undecided
    if not stripped.startswith("{"):
        return Parsed(len(text), [])
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos = lead
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # incomplete (still being written, or cut off)
        call = _as_call(obj, ("parameters", "arguments"))
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
    if final and not calls:
        return Parsed(len(text), [])
    return Parsed(0, calls)


# ---------------------------------------------------------------- forced tool choices (generated under a grammar)


def parse_call_array(text: str, final: bool) -> Parsed:
    """tool_choice="required": the grammar makes the reply a JSON array of {"name": ..., "parameters": {...}}.
    Each element is listed once it closes; a reply cut off by max_tokens keeps the elements that closed."""
    calls: list[ParsedCall] = []
    depth, in_string, escaped, obj_start = 0, False, False, -1
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                obj_start = i
        elif ch in "]}":
            depth -= 1
            if depth == 1 and ch == "}" and obj_start >= 0:
                try:
                    call = _as_call(json.loads(text[obj_start : i + 1]), ("parameters", "arguments"))
                except json.JSONDecodeError:
                    call = None
                if call is not None:
                    calls.append(call)
                obj_start = -1
    return Parsed(0, calls)


def named_call_parser(name: str) -> ToolParser:
    """A named tool choice: the grammar makes the whole reply the function's arguments object."""

    def parse(text: str, final: bool) -> Parsed:
        return Parsed(0, [ParsedCall(name, text)] if text or final else [])

    return parse


# The formats a server can read from free text (--tool-call-parser).
TOOL_CALL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}

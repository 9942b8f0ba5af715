"""Tool calls out of generated text: one parser per format a model is trained to write, and the two formats a
forced tool choice generates under its grammar.

A parser reads the text so far and returns the length of its plain-content prefix and the calls it holds so far.
Called as a function it reads a whole text. A stream's text only grows, so each stream takes a reader of its own
(``parser.reader()``) that remembers what it already read: the calls it closed and where to go on from. Each delta
then costs about its own length (and the call still being written), not the whole reply's: a reply of 64 calls
re-read at every delta cost ~0.5-1.3 ms a delta (BENCHMARKS §48). Two rules keep a stream and the final answer the same:
the content prefix only grows (text that may still turn into a call is held back, as a stop string is), and a call
is listed only once its JSON is complete, except a named tool choice's, whose whole output is the arguments and so
grows as a prefix of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object (a prefix of it while a named call streams)


@dataclasses.dataclass
class Parsed:
    content_end: int  # text[:content_end] is plain content
    calls: list[ParsedCall]


class ToolParser:
    """One format. ``parser(text, final)`` reads a whole text; ``parser.reader()`` is a fresh reader for one stream,
    whose ``read(text, final)`` must be given the same text grown at each call."""

    def reader(self) -> "ToolParser":
        return type(self)()

    def __call__(self, text: str, final: bool) -> Parsed:
        return self.reader().read(text, final)

    def read(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


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
    first = marker[0]
    i = text.find(first, max(0, len(text) - len(marker) + 1))
    while i >= 0:  # the earliest start of a marker prefix in the tail, found from the marker's first character
        if marker.startswith(text[i:]):
            return i
        i = text.find(first, i + 1)
    return len(text)


# ---------------------------------------------------------------- hermes: <tool_call>{json}</tool_call>

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    """Hermes-style calls (Qwen2/2.5/3, Hermes, and most chat templates with tools): each call is
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Content is the text before the first call;
    when the final text holds no valid call, all of it is content."""

    def __init__(self) -> None:
        self._searched = 0  # text[:_searched] holds no opening tag (before the first call)
        self._start = -1  # where the first call opens
        self._calls: list[ParsedCall] = []  # the calls closed so far
        self._after = 0  # where the text after the last closed call starts
        self._broken = False  # a closed call's JSON was not a call: nothing after it is read

    def read(self, text: str, final: bool) -> Parsed:
        if self._start < 0:
            self._start = text.find(_HERMES_OPEN, max(0, self._searched - len(_HERMES_OPEN) + 1))
            if self._start < 0:
                self._searched = len(text)
                return Parsed(len(text) if final else _held_back(text, _HERMES_OPEN), [])
            self._after = self._start
        calls = list(self._calls)
        while not self._broken:
            pos = text.find(_HERMES_OPEN, self._after)
            if pos < 0:
                break
            body_start = pos + len(_HERMES_OPEN)
            end = text.find(_HERMES_CLOSE, body_start)
            if end < 0:  # still being written; a final text's JSON decides, unremembered
                call = _hermes_call(text[body_start:]) if final else None
                if call is not None:
                    calls.append(call)
                break
            call = _hermes_call(text[body_start:end])
            if call is None:
                self._broken = True  # not a call we can read: stop here, keep what came before
                break
            self._calls.append(call)
            calls.append(call)
            self._after = end + len(_HERMES_CLOSE)
        if final and not calls:
            return Parsed(len(text), [])
        return Parsed(self._start, calls)


def _hermes_call(body: str) -> Optional[ParsedCall]:
    try:
        return _as_call(json.loads(body), ("arguments", "parameters"))
    except json.JSONDecodeError:
        return None


# ---------------------------------------------------------------- llama3_json: {"name": ..., "parameters": ...}

_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonParser(ToolParser):
    """Llama 3.1+ JSON calls: the reply starts (after an optional ``<|python_tag|>``) with
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``. A reply that starts with anything else is
    content."""

    def __init__(self) -> None:
        self._content = False  # decided: the reply is content
        self._pos = -1  # where the next call starts (-1: the calls' start not found yet)
        self._calls: list[ParsedCall] = []
        self._broken = False  # a complete JSON value that was not a call: nothing after it is read

    def read(self, text: str, final: bool) -> Parsed:
        if self._content:
            return Parsed(len(text), [])
        if self._pos < 0:
            stripped = text.lstrip()
            if stripped.startswith(_PYTHON_TAG):
                stripped = stripped[len(_PYTHON_TAG) :].lstrip()
                if not final and not stripped:
                    return Parsed(0, [])  # the tag, and nothing after it yet: a call follows, undecided
            elif not final and _PYTHON_TAG.startswith(stripped):
                return Parsed(0, [])  # only whitespace, or the tag's start: undecided
            if not stripped.startswith("{"):
                self._content = True
                return Parsed(len(text), [])
            self._pos = len(text) - len(stripped)
        calls = list(self._calls)
        while not self._broken:
            while self._pos < len(text) and (text[self._pos].isspace() or text[self._pos] == ";"):
                self._pos += 1  # between calls (the text may have stopped here last time)
            if self._pos >= len(text):
                break
            try:
                obj, end = _DECODER.raw_decode(text, self._pos)
            except json.JSONDecodeError:
                break  # incomplete (still being written, or cut off)
            call = _as_call(obj, ("parameters", "arguments"))
            if call is None:
                self._broken = True
                break
            self._calls.append(call)
            calls.append(call)
            self._pos = end
        if final and not calls:
            return Parsed(len(text), [])
        return Parsed(0, calls)


# ---------------------------------------------------------------- forced tool choices (generated under a grammar)


class CallArrayParser(ToolParser):
    """tool_choice="required": the grammar makes the reply a JSON array of {"name": ..., "parameters": {...}}.
    Each element is listed once it closes; a reply cut off by max_tokens keeps the elements that closed. The scan
    goes on from where the last read stopped, in the string and nesting state it left."""

    def __init__(self) -> None:
        self._i = 0  # characters scanned
        self._depth, self._in_string, self._escaped, self._obj_start = 0, False, False, -1
        self._calls: list[ParsedCall] = []

    def read(self, text: str, final: bool) -> Parsed:
        depth, in_string, escaped, obj_start = self._depth, self._in_string, self._escaped, self._obj_start
        for i in range(self._i, len(text)):
            ch = text[i]
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
                        self._calls.append(call)
                    obj_start = -1
        self._i = len(text)
        self._depth, self._in_string, self._escaped, self._obj_start = depth, in_string, escaped, obj_start
        return Parsed(0, list(self._calls))


class NamedCallParser(ToolParser):
    """A named tool choice: the grammar makes the whole reply the function's arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name

    def reader(self) -> "NamedCallParser":
        return self  # it keeps no state

    def read(self, text: str, final: bool) -> Parsed:
        return Parsed(0, [ParsedCall(self.name, text)] if text or final else [])


parse_hermes = HermesParser()
parse_llama3_json = Llama3JsonParser()
parse_call_array = CallArrayParser()


def named_call_parser(name: str) -> ToolParser:
    return NamedCallParser(name)


# The formats a server can read from free text (--tool-call-parser).
TOOL_CALL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}

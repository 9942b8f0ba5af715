"""Function calling on /v1/chat/completions: what a request's tools and tool_choice ask of the engine, and the
reply's tool calls, whole or as stream deltas.

tool_choice decides how calls are made:
- "none": the tools reach the chat template, the reply is plain content.
- "auto" (OpenAI's default with tools): the model decides; the server's --tool-call-parser reads calls out of
  the text (tool_parsers.py). Needs --enable-auto-tool-choice, as in vLLM.
- "required" / a named function: a JSON-schema grammar (structured outputs) forces an array of calls / the
  named function's arguments, so any model makes a valid call.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Optional

from jaxserve.server.tool_parsers import (
    TOOL_CALL_PARSERS, Parsed, ParsedCall, ToolParser, named_call_parser, parse_call_array,
)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without any


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _EMPTY_PARAMETERS


def forced_call_schema(tools: list, tool_choice, parallel_tool_calls: bool) -> Optional[dict[str, Any]]:
    """The JSON schema a forced tool choice generates under (None for "none" and "auto"): a named function's
    parameters, or for "required" an array of {"name", "parameters"} objects, one branch per tool."""
    if isinstance(tool_choice, str) and tool_choice != "required":
        return None
    if not isinstance(tool_choice, str):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return _parameters(tool)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one request's reply is read: which parser, and whether its calls make finish_reason "tool_calls"."""

    parser: Optional[ToolParser]  # None: plain content
    finish_as_tool_calls: bool  # "auto" and "required" (OpenAI answers "stop" for a named function)
    max_calls: Optional[int] = None  # parallel_tool_calls=false under "auto": the first call only
    # Hermes models may have <tool_call> as a special token: the text must keep it to be read (as in vLLM).
    keep_special_tokens: bool = False

    @classmethod
    def for_request(cls, body, server_parser: Optional[str]) -> "ToolPlan":
        """The plan for a validated ChatCompletionRequest; ValueError naming the field when the server cannot
        do what it asks."""
        choice = body.effective_tool_choice
        if choice == "none":
            return cls(None, False)
        if choice == "auto":
            if server_parser is None:
                raise ValueError(
                    'tool_choice="auto" (the default when tools are given) is invalid here: this server reads tool '
                    "calls from free text only when started with --enable-auto-tool-choice --tool-call-parser "
                    f"{{{','.join(TOOL_CALL_PARSERS)}}}; send tool_choice=\"required\", a named function, or \"none\""
                )
            return cls(TOOL_CALL_PARSERS[server_parser], True, None if body.parallel_tool_calls else 1,
                       keep_special_tokens=server_parser == "hermes")
        if choice == "required":
            return cls(parse_call_array, True)
        return cls(named_call_parser(choice.function.name), False)

    def finish_reason(self, called: bool, engine_reason: Optional[str]) -> Optional[str]:
        """A reply that made calls and ended on its own finishes with "tool_calls" (under auto/required)."""
        if called and self.finish_as_tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def new_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(12)}"


class ToolCallStream:
    """One choice's reply as (content, tool calls): fed the text's deltas, it says what is new in each, so the
    joined deltas equal the non-streamed reply."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._reader = plan.parser.reader()  # remembers what it read: each delta costs its own length
        self.text = ""
        self.ids: list[str] = []  # one id per call sent so far
        self._content_sent = 0
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _parse(self, final: bool) -> Parsed:
        parsed = self._reader.read(self.text, final)
        if self.plan.max_calls is not None:
            parsed.calls = parsed.calls[: self.plan.max_calls]
        return parsed

    def feed(self, delta: str, final: bool) -> tuple[str, list[tuple[int, Optional[str], ParsedCall]]]:
        """New content, and per call (index, its id on the call's first delta else None, name and the arguments'
        new text)."""
        self.text += delta
        parsed = self._parse(final)
        end = max(parsed.content_end, self._content_sent)
        content, self._content_sent = self.text[self._content_sent : end], end
        out = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self._args_sent.append(len(call.arguments))
                out.append((i, self.ids[i], call))
            elif len(call.arguments) > self._args_sent[i]:
                out.append((i, None, ParsedCall(call.name, call.arguments[self._args_sent[i] :])))
                self._args_sent[i] = len(call.arguments)
        return content, out

    def whole(self, text: str) -> tuple[Optional[str], list[tuple[str, ParsedCall]]]:
        """A finished reply at once: (content, or None when there is none besides calls; [(id, call)])."""
        content, calls = self.feed(text, final=True)
        if calls and not content.strip():
            content = None
        return content, [(call_id, call) for _, call_id, call in calls]

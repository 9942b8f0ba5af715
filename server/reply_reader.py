"""One reply read the way a chat reply is: a reasoning model's <think> block, the answer, and the tool calls in the
answer. Fed the text's deltas, it says what each added; the chat and responses routes share it."""

from __future__ import annotations

from typing import Optional

from jaxserve.reasoning import ReasoningFormat, ReasoningStream

from jaxserve.server.tool_calls import ToolCallStream, ToolPlan
from jaxserve.server.tool_parsers import ParsedCall


class ReplyReader:
    def __init__(self, fmt: Optional[ReasoningFormat], reply_state: Optional[str], tools: ToolPlan) -> None:
        self.thought = ReasoningStream(fmt, reply_state) if reply_state is not None else None
        self.calls = ToolCallStream(tools) if tools.parser is not None else None

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[tuple[int, Optional[str], ParsedCall]]]:
        """(new reasoning, new answer text, new call deltas as ToolCallStream.feed gives them)."""
        reasoning, text = ("", delta) if self.thought is None else self.thought.feed(delta, final)
        if self.calls is None:
            return reasoning, text, []
        content, made = self.calls.feed(text, final)
        return reasoning, content, made

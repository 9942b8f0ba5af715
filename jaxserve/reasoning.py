"""Reasoning models: the text between <think> and </think>, told apart from the answer (vLLM's --reasoning-parser).

Two formats, both with the tags ``<think>`` and ``</think>`` as single tokens of the tokenizer:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the reply reasons first, whether or not it opens with
  ``<think>`` (the chat template often puts it in the prompt), and answers after ``</think>``.
- ``qwen3`` (Qwen3): the reply reasons only if it opens with ``<think>``, or if the prompt left a ``<think>``
  open; a reply without one (an instruct model, thinking switched off) is all answer.

Where a reply starts is decided by the prompt's end (``prompt_state``): a prompt that ends in ``</think>`` (Qwen3's
template with ``enable_thinking=False`` closes an empty block) leaves nothing to reason, one that ends in ``<think>``
is reasoning already, and any other leaves it to the format. ``ReasoningStream`` cuts a reply fed as deltas, and
``split`` a whole reply by feeding it at once, so both cut the text at the same place. The engine uses the same
states to hold a request's structured output back until its reasoning is over (structured_output.ReasoningGate).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

START, END = "<think>", "</think>"

# The state a reply starts in, and moves through.
UNDECIDED = "undecided"  # it may open <think> with its first token, or answer
THINKING = "thinking"  # every token until </think> is reasoning
ANSWERING = "answering"  # reasoning is over (or never began)


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    # Where a reply goes that the prompt leaves open and that does not begin with <think>: THINKING (deepseek_r1)
    # or ANSWERING (qwen3). Only the latter needs the UNDECIDED state.
    unprompted: str
    start: str = START
    end: str = END


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", unprompted=THINKING),
    "qwen3": ReasoningFormat("qwen3", unprompted=ANSWERING),
}


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser={name!r} is not a known format; choose one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


def prompt_state(fmt: ReasoningFormat, prompt_tail: str) -> str:
    """The state a reply starts in, from the prompt's last characters (trailing whitespace ignored): ANSWERING after a
    closed block, THINKING in an open one, else UNDECIDED for a format whose replies choose (qwen3), THINKING for
    one whose replies always reason first (deepseek_r1)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.end):
        return ANSWERING
    if tail.endswith(fmt.start):
        return THINKING
    return UNDECIDED if fmt.unprompted == ANSWERING else THINKING


def prompt_state_of_ids(fmt: ReasoningFormat, tokenizer, prompt_ids) -> str:
    """``prompt_state`` of a tokenized prompt: its last few tokens decoded with their special tokens."""
    return prompt_state(fmt, tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False))


def tag_token_ids(fmt: ReasoningFormat, tokenizer) -> tuple[int, int]:
    """(id of <think>, id of </think>); ValueError when the tokenizer does not hold each tag as one token."""
    ids = []
    for tag in (fmt.start, fmt.end):
        encoded = list(tokenizer.encode(tag, add_special_tokens=False))
        if len(encoded) != 1:
            raise ValueError(
                f"reasoning_parser={fmt.name!r} needs {fmt.start!r} and {fmt.end!r} as single tokens, but this "
                f"model's tokenizer encodes {tag!r} as {encoded}: it is not a reasoning model of that format; leave "
                "reasoning_parser unset"
            )
        ids.append(encoded[0])
    return ids[0], ids[1]


def reasoning_tags(name: Optional[str], tokenizer) -> Optional[tuple[ReasoningFormat, int, int]]:
    """(format, id of <think>, id of </think>) for EngineArgs.reasoning_parser ``name``, or None when unset;
    ValueError when there is no tokenizer or it cannot hold the format's tags."""
    if name is None:
        return None
    fmt = reasoning_format(name)
    if tokenizer is None:
        raise ValueError(f"reasoning_parser={name!r} reads the model's text, which needs its tokenizer: start the "
                         "engine without skip_tokenizer_init, or leave reasoning_parser unset")
    return (fmt, *tag_token_ids(fmt, tokenizer))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (text to hold back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclasses.dataclass
class Split:
    reasoning: Optional[str]  # None: the reply did not reason
    content: str


def split(fmt: ReasoningFormat, state: str, text: str, final: bool) -> Split:
    """Cut a reply (so far) into reasoning and answer, starting in ``state``: the whole text fed to a stream at once.
    Unless ``final``, a tag's possible beginning at the end is held back, and so is a reply too short to tell whether
    it opens with <think>."""
    stream = ReasoningStream(fmt, state)
    reasoning, content = stream.feed(text, final)
    return Split(reasoning if stream.reasoned else None, content)


class ReasoningStream:
    """One choice's reply fed as deltas: each ``feed`` returns the reasoning and the answer text that are new. It keeps
    only the text not yet sent (at most a tag's length once the reply's opening is known), so a delta costs its own
    length, however long the reasoning; the text up to ``</think>`` is reasoning (a leading ``<think>`` dropped), the
    rest the answer."""

    def __init__(self, fmt: ReasoningFormat, state: str) -> None:
        self.fmt = fmt
        self.phase = "answer" if state == ANSWERING else "opening"
        self.state = state
        self.pending = ""  # received, not yet sent
        self.reasoned = False  # the reply has a reasoning block (possibly empty)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        if self.phase == "answer":
            return "", delta
        self.pending += delta
        if self.phase == "opening":  # does the reply begin with <think>?
            start = self.fmt.start
            if self.pending.startswith(start):
                self.pending = self.pending[len(start) :]  # (a reply may repeat the <think> its prompt opened)
            elif not final and start.startswith(self.pending):
                return "", ""  # "" or "<thi": it may yet open with <think>
            elif self.state == UNDECIDED:  # it answered at once
                self.phase, text, self.pending = "answer", self.pending, ""
                return "", text
            self.phase, self.reasoned = "reasoning", True
        end = self.pending.find(self.fmt.end)
        if end >= 0:
            reasoning, answer = self.pending[:end], self.pending[end + len(self.fmt.end) :]
            self.phase, self.pending = "answer", ""
            return reasoning, answer
        keep = 0 if final else _partial_suffix(self.pending, self.fmt.end)
        reasoning, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return reasoning, ""

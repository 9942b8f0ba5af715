"""Cumulative engine outputs -> per-choice deltas for streaming, and the final choices for plain responses.

The engine hands back whole texts so far; a stream sends only what is new. Because the engine's
text only grows (stop strings are held back until decided), joining the deltas gives exactly the
text of a non-streamed response.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import AsyncIterator, Optional

from jaxserve.async_engine import RequestStream
from jaxserve.outputs import CompletionOutput, LogprobsDict, RequestOutput

from jaxserve.server.sse import merge

logger = logging.getLogger("jaxserve.server")


@dataclasses.dataclass
class Delta:
    """What one choice gained since the last chunk."""

    index: int  # the choice index in the response: prompt_index * n + sample index
    text: str
    token_ids: list[int]
    logprobs: Optional[list[LogprobsDict]]  # one dict per new token, when logprobs were asked for
    finish_reason: Optional[str]
    stop_reason: Optional[int | str]
    first: bool  # the first chunk of this choice (chat sends the role in it)


@dataclasses.dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    finished: bool = False
    started: bool = False


class DeltaTracker:
    """Remembers, per choice, how much has been sent, and counts tokens for usage."""

    def __init__(self, n: int, prompt_lens: list[int], *, prompt_details: bool = False) -> None:
        self.n = n
        self.prompt_lens = prompt_lens
        self.prompt_details = prompt_details  # usage reports the prompt's cached tokens (--enable-prompt-tokens-details)
        self._sent: dict[int, _Sent] = {}
        self._cached: dict[int, int] = {}  # prompt index -> its tokens served from the prefix cache
        self.completion_tokens = 0
        self.counts_completion = True  # False: the tokens are not returned (completions' echo with max_tokens=0)

    def update(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        self._cached[prompt_index] = out.num_cached_tokens
        deltas = []
        for comp in out.outputs:
            d = self._delta(prompt_index * self.n + comp.index, comp)
            if d is not None:
                deltas.append(d)
        return deltas

    def _delta(self, index: int, comp: CompletionOutput) -> Optional[Delta]:
        sent = self._sent.setdefault(index, _Sent())
        if sent.finished:
            return None
        if len(comp.text) < sent.chars:
            # Should not happen (the engine's text only grows); never resend, just note it.
            logger.warning("choice %d text shrank from %d to %d chars while streaming", index, sent.chars, len(comp.text))
        new_tokens = comp.token_ids[sent.tokens :]
        text = comp.text[sent.chars :]
        finished = comp.finish_reason is not None
        if not text and not new_tokens and not finished:
            return None
        logprobs = comp.logprobs[sent.tokens : len(comp.token_ids)] if comp.logprobs is not None else None
        if self.counts_completion:
            self.completion_tokens += len(new_tokens)
        first = not sent.started
        sent.chars = max(sent.chars, len(comp.text))
        sent.tokens = len(comp.token_ids)
        sent.finished = finished
        sent.started = True
        return Delta(index, text, new_tokens, logprobs, comp.finish_reason, comp.stop_reason, first)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, over the prompts seen so far (once per prompt, whatever n)."""
        return sum(self._cached.values())


async def stream_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, newest output) as they arrive from all of a response's engine requests."""
    async for i, out in merge(streams):
        yield i, out


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every engine request of a response to finish; their final outputs, in prompt order."""
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    async for i, out in merge(streams):
        if out.finished:
            finals[i] = out
    missing = [s.request_id for s, f in zip(streams, finals) if f is None]
    if missing:
        raise RuntimeError(f"requests {missing} ended without a final output")
    return finals  # type: ignore[return-value]

"""Incremental detokenization with stop strings: token ids in, safe-to-stream text deltas out.

Two jobs, one per layer:
- ``_TokenStream`` turns tokens into text without ever producing half a character: a UTF-8
  character split over several byte-level tokens appears whole once its last byte arrives.
  It uses ``tokenizers.decoders.DecodeStream`` on a fast tokenizer's backend, or else the
  prefix / read-offset method over ``tokenizer.decode`` for any other tokenizer.
- ``IncrementalDetokenizer`` cuts the text at the first stop string and holds back any tail that
  could still become the start of one, so a streamed delta never contains text that is cut later.

The stream is primed with the last few prompt tokens, so the first generated token decodes as it
does after the prompt (a leading space that SentencePiece decoders strip at the start is kept).
"""

from __future__ import annotations

from typing import Optional, Sequence

from jaxserve.sampling_params import SamplingParams

try:
    from tokenizers import Tokenizer as _BackendTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a hard dependency; kept for clarity
    _BackendTokenizer = None
    DecodeStream = None

# Prompt tokens decoded as context before the first generated token (enough for a merge to settle).
PROMPT_CONTEXT_TOKENS = 6


def decode_token(tokenizer, token_id: int) -> str:
    """One token's own text (for ``Logprob.decoded_token``); part of a multi-byte character shows as U+FFFD."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class _TokenStream:
    """Decodes one token at a time; ``step`` returns only whole characters ("" while one is incomplete)."""

    def __init__(self, tokenizer, context: Sequence[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(context)
        # A prompt that ends inside a character would leak its bytes into the first delta.
        if context and self._decode(context).endswith("\ufffd"):
            context = []
        self._ids: list[int] = []  # context + generated tokens
        self._prefix_offset = 0  # start of the window re-decoded each step (context for merges/spaces)
        self._read_offset = 0  # tokens before this have been emitted
        backend = tokenizer if _is_backend(tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if _is_backend(backend) and DecodeStream is not None:
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:  # prime only: the prompt's text is not output
            self.step(token_id)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:  # DecodeStream, inline: this runs for every token of every request
            try:
                text = self._stream.step(self._backend, token_id) or ""
            except Exception:  # DecodeStream rejects some decoders' outputs ("Invalid prefix encountered")
                # Carry on with the slower method from the last emitted token; nothing is lost or repeated.
                self._stream = None
                self._prefix_offset = max(0, self._read_offset - PROMPT_CONTEXT_TOKENS)
                self._ids.pop()
                return self.step(token_id)
            if text:
                self._read_offset = len(self._ids)
            return text
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means the last token ended mid-character: wait for the rest of it.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]


def _is_backend(obj) -> bool:
    return _BackendTokenizer is not None and isinstance(obj, _BackendTokenizer)


class IncrementalDetokenizer:
    """A request's output text, built token by token, with ``params.stop`` strings applied.

    ``update(ids)`` returns the new text that is safe to stream. ``output_text`` is everything
    returned so far (the cumulative text). Once a stop string is found, ``stop_string`` names it,
    the text ends just before it (or just after, with ``include_stop_str_in_output``) and later
    updates return "". When the request ends for another reason, ``finish()`` releases the text
    that was held back because it could have started a stop string.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        context = list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:] if prompt_token_ids else []
        self._stream = _TokenStream(tokenizer, context, params.skip_special_tokens)
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.output_text = ""
        self._held = ""  # decoded, not yet returned: a suffix that is a proper prefix of a stop string
        self.stop_string: Optional[str] = None

    @property
    def has_stops(self) -> bool:
        """Whether any stop string is watched for (its text must then be built as tokens arrive)."""
        return bool(self._stops)

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Feed newly generated tokens; returns the text delta to stream (may be "")."""
        if self.stop_string is not None:
            return ""
        return self._take("".join(self._stream.step(int(t)) for t in new_token_ids))

    def update_one(self, token_id: int) -> str:
        """``update([token_id])`` without the list and the join: the engine feeds one token at a time."""
        if self.stop_string is not None:
            return ""
        return self._take(self._stream.step(int(token_id)))

    def _take(self, new_text: str) -> str:
        if not self._stops:
            self.output_text += new_text
            return new_text
        return self._emit(self._held + new_text)

    def finish(self) -> str:
        """The request ended without a stop string: return (and append) the held-back text."""
        delta, self._held = self._held, ""
        self.output_text += delta
        return delta

    def _emit(self, pending: str) -> str:
        # An occurrence may begin in text already returned when the stop string itself is kept
        # (nothing is held back then), so search a little of the returned text too.
        before = self.output_text[max(0, len(self.output_text) - self._longest_stop + 1) :]
        found = _first_stop(before + pending, self._stops)
        if found is not None:
            start, stop = found
            cut = start + len(stop) if self._include_stop else start
            delta = pending[: max(0, cut - len(before))]
            self.stop_string, self._held = stop, ""
        else:
            keep = 0 if self._include_stop else _stop_prefix_len(pending, self._stops)
            delta, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.output_text += delta
        return delta


def _first_stop(text: str, stops: list[str]) -> Optional[tuple[int, str]]:
    """The stop string that is completed first in ``text`` (earliest end; the longer on a tie)."""
    best: Optional[tuple[int, int, str]] = None  # (end, -length, stop)
    for stop in stops:
        i = text.find(stop)
        if i >= 0:
            key = (i + len(stop), -len(stop), stop)
            best = key if best is None or key < best else best
    return None if best is None else (best[0] + best[1], best[2])


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest

"""Prompt-lookup (n-gram) proposals: continue the sequence as it went on after an earlier copy of its tail.

Host-side numpy, no model. For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens
are searched for in the earlier tokens (prompt and output); at the most recent earlier occurrence, the up to k
tokens that followed it are the proposal. Code edits, summaries that quote the input and repeated structure
make such matches common; elsewhere it proposes nothing and the step is an ordinary decode.

This runs after every verify step, between reading the step back and launching the next, where nothing hides
its cost, so it is kept to a few numpy calls whatever n: the places where the last token occurs before are found
in one pass, and only there is the match extended backwards (at most ``prompt_lookup_max`` tokens). A running
request's tokens live in a numpy buffer that grows by the few tokens of each step instead of being converted
from the list again.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # key (a Request: held, so never mistaken for a newer one) -> (tokens [capacity] i64, how many are filled)
        self._buffers: dict[object, tuple[np.ndarray, int]] = {}

    def propose(self, token_ids: list[int], k: int, key: Optional[object] = None) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence of ``token_ids`` (prompt + output), or []. ``key``: an
        object standing for this sequence while it grows (its Request), to keep its tokens in a buffer across
        calls: between calls its tokens may only grow, or get shorter (a stop string truncating a finished request's
        output), which starts the buffer over; ``retain`` drops the buffers of sequences that ended."""
        if k <= 0:
            return []
        tokens = self._tokens(token_ids, key)  # [L]
        length = len(tokens)
        longest = min(self.max_n, length - 1)
        if longest < self.min_n:
            return []
        # Ends of earlier copies: positions e <= L-2 holding the last token (a copy may not be the suffix itself).
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C] ascending
        if not len(ends):
            return []
        # How far each copy matches backwards, up to ``longest`` tokens: [C, longest] compares, then the run length.
        back = ends[:, None] - np.arange(longest)  # [C, longest] positions e - m
        same = (back >= 0) & (tokens[np.maximum(back, 0)] == tokens[length - 1 - np.arange(longest)])
        matched = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # [C]
        # The longest n with a copy, then its most recent copy; the proposal is what followed it.
        best = int(matched.max())
        if best < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched >= best)[-1]]) + 1
        return tokens[start : start + k].tolist()

    def retain(self, keys) -> None:
        """Keep the buffers of ``keys`` only (the requests still running)."""
        keep = set(map(id, keys))
        self._buffers = {key: b for key, b in self._buffers.items() if id(key) in keep}

    def _tokens(self, token_ids: list[int], key: Optional[object]) -> np.ndarray:
        """``token_ids`` as an int64 array: a view of the key's buffer, extended by the tokens added since."""
        length = len(token_ids)
        if key is None:
            return np.asarray(token_ids, np.int64)
        buf, filled = self._buffers.get(key, (None, 0))
        if buf is None or filled > length or (filled and buf[filled - 1] != token_ids[filled - 1]):
            # New, or not the tokens it held (a stop string truncated them): start over.
            buf, filled = np.empty(max(64, 2 * length), np.int64), 0
        elif length > len(buf):  # grow by doubling: amortised O(1) a token
            grown = np.empty(2 * length, np.int64)
            grown[:filled] = buf[:filled]
            buf = grown
        if length > filled:
            buf[filled:length] = token_ids[filled:length]
        self._buffers[key] = (buf, length)
        return buf[:length]

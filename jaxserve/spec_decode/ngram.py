"""Prompt-lookup (n-gram) proposals: continue the sequence as it went on after an earlier copy of its tail.

Host-side numpy, no model. For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens
are searched for in the earlier tokens (prompt and output); at the most recent earlier occurrence, the up to k
tokens that followed it are the proposal. Code edits, summaries that quote the input and repeated structure
make such matches common; elsewhere it proposes nothing and the step is an ordinary decode.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for a sequence of ``token_ids`` (prompt + output), or []."""
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, np.int64)  # [L]
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]  # [n]
            # Windows starting at 0 .. L-n-1: every earlier place the suffix could sit (not the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L-n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the token after the most recent earlier copy
                return tokens[start : start + k].tolist()
        return []

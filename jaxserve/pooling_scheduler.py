"""Batches embedding requests: prefill-only, so a request runs in exactly one step and needs no KV blocks.

It keeps the generate scheduler's limits (``max_num_batched_tokens``, ``max_num_seqs``) and its order
(first come, first served); a whole prompt always fits one step because the engine keeps max_model_len within
the token budget (``pooling_engine.pooling_limits``). No JAX here.

Where each prompt goes in the step's flat token array is decided here too: the array is cut into rows of
``row_len`` tokens (a power of two >= max_model_len), each prompt is placed whole in the first row with room
(first fit), and attention runs within rows. So a step of T tokens computes T/R blocks of [R, R] scores, not
one [T, T]; the few tokens left at the end of a row are padding.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Optional

from jaxserve.pooling_params import PoolingParams


@dataclasses.dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    arrival_time: float
    prompt: Optional[str] = None


class PoolingScheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, row_len: Optional[int] = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.row_len = row_len or max_num_batched_tokens
        if max_num_batched_tokens % self.row_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is not a multiple of row_len={row_len}")
        self.waiting: collections.OrderedDict[str, PoolingRequest] = collections.OrderedDict()

    def add_request(self, req: PoolingRequest) -> None:
        if len(req.prompt_token_ids) > self.row_len:
            raise ValueError(
                f"prompt of {len(req.prompt_token_ids)} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} (rows of {self.row_len}): a pooling prompt runs whole in one step"
            )
        self.waiting[req.request_id] = req

    def abort(self, request_ids: Iterable[str]) -> list[PoolingRequest]:
        return [r for r in (self.waiting.pop(i, None) for i in request_ids) if r is not None]

    def schedule(self) -> list[tuple[PoolingRequest, int]]:
        """The next step's requests with the flat index of each one's first token, taken off the queue in
        arrival order while they fit: first fit into rows of ``row_len``, at most budget / row_len rows."""
        batch: list[tuple[PoolingRequest, int]] = []
        fill: list[int] = []  # tokens placed in each row so far
        max_rows = self.max_num_batched_tokens // self.row_len
        while self.waiting and len(batch) < self.max_num_seqs:
            req = next(iter(self.waiting.values()))
            n = len(req.prompt_token_ids)
            row = next((i for i, used in enumerate(fill) if used + n <= self.row_len), None)
            if row is None:
                if len(fill) == max_rows:
                    break
                fill.append(0)
                row = len(fill) - 1
            batch.append((self.waiting.pop(req.request_id), row * self.row_len + fill[row]))
            fill[row] += n
        return batch

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

"""Batches embedding requests: prefill-only, so a request runs in exactly one step and needs no KV blocks.

It keeps the generate scheduler's limits (``max_num_batched_tokens``, ``max_num_seqs``) and its order
(first come, first served); a whole prompt always fits one step because the engine keeps max_model_len within
the token budget (``pooling_engine.pooling_limits``). No JAX here.
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
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.OrderedDict[str, PoolingRequest] = collections.OrderedDict()

    def add_request(self, req: PoolingRequest) -> None:
        if len(req.prompt_token_ids) > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt of {len(req.prompt_token_ids)} tokens exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: a pooling prompt runs in one step"
            )
        self.waiting[req.request_id] = req

    def abort(self, request_ids: Iterable[str]) -> list[PoolingRequest]:
        return [r for r in (self.waiting.pop(i, None) for i in request_ids) if r is not None]

    def schedule(self) -> list[PoolingRequest]:
        """The next step's requests, taken off the queue in arrival order while they fit the budget."""
        batch: list[PoolingRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            req = next(iter(self.waiting.values()))
            if tokens + len(req.prompt_token_ids) > self.max_num_batched_tokens:
                break
            tokens += len(req.prompt_token_ids)
            batch.append(self.waiting.pop(req.request_id))
        return batch

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

import dataclasses
from typing import Optional

# One position's logprobs: {token_id: Logprob}, the sampled token first, then the top alternatives.
LogprobsDict = dict[int, "Logprob"]


@dataclasses.dataclass(slots=True)  # one per logprob entry: prompt logprobs make one or more per prompt token
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = most likely under the model
    decoded_token: Optional[str] = None


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request. ``text``/``token_ids`` are cumulative (the whole completion so far).
    (jaxserve.output_processor builds it by position: keep it in step when adding or moving a field.)"""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[LogprobsDict]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[int | str] = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's state after a step. ``finished`` once every sample has finished.
    (jaxserve.output_processor builds it by position: keep it in step when adding or moving a field.)"""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: Optional[dict] = None  # arrival / first-token / finish times (time.monotonic seconds)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it),
    # then {token_id: Logprob} with the prompt token and its top alternatives. None until the prompt is computed.
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]] = None

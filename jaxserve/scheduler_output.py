"""The contract between the scheduler (host, no arrays) and the model runner (device, no block objects)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)  # one per sequence per step: slots make it cheaper to build and read
class ScheduledSeq:
    """One sequence's share of a step. (Scheduler._scheduled_seq passes the fields by position: keep it in step when
    adding or moving one.)"""

    req_id: str
    # The tokens to compute this step: all_token_ids[start_pos : start_pos + len]. The last
    # ``num_placeholders`` of them were sampled by the step still in flight and are not known on the
    # host yet: they are -1 here, and the runner takes them from that step's device output.
    token_ids: list[int]
    start_pos: int  # num_computed_tokens before this step (position of token_ids[0])
    block_ids: list[int]  # the sequence's whole block table (covers start_pos + len(token_ids) slots)
    sample: bool  # this step reaches the sequence's last known token: a new token is sampled from it
    sampling_params: SamplingParams
    seed: int  # per-request RNG seed
    num_output_tokens: int  # tokens generated so far (the sampler folds it into the key)
    history: list[int]  # prompt + output tokens (read only; used by penalties), prompt first
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # banned (with stop_token_ids) until min_tokens are generated
    num_placeholders: int = 0  # 0 or 1: trailing token_ids to take from the previous step's samples
    prev_row: int = -1  # with a placeholder: the row of this sequence in the previous step's samples
    # Speculative decoding: the trailing ``num_spec_tokens`` of token_ids are proposals to verify, not yet part
    # of the sequence; the step scores each of them and returns the accepted ones plus one more token.
    num_spec_tokens: int = 0
    lora_request: Optional[LoRARequest] = None  # the adapter this sequence runs with (None: the base model)
    # A vision-language request's images and M-RoPE rows (jaxserve.multimodal.MultiModalInputs), or None.
    mm: Any = None
    # This step's tokens of the prompt should be scored for prompt logprobs (jaxserve.prompt_logprobs).
    prompt_logprobs: bool = False
    # With structured outputs: the sample's jaxserve.structured_output.Grammar (its mask row is filled at input
    # building, or after the step in flight is read back: ModelRunner.sample_deferred).
    grammar: Any = None


@dataclasses.dataclass
class SchedulerOutput:
    """What to run this step. ``seqs`` order is the row order of the sampled tokens returned."""

    seqs: list[ScheduledSeq]
    num_batched_tokens: int  # sum of len(seq.token_ids)
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    # The scheduler's own Request objects, parallel to seqs, so that results read back a step later
    # land on the request that was scheduled even if its id was reused meanwhile. Not for the runner.
    requests: list = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclasses.dataclass
class ModelRunnerOutput:
    """What one step produced, one row per scheduled sequence (rows of seqs with sample=False are unused)."""

    sampled_token_ids: list[int]
    # With logprobs asked for by any request in the batch: per row, the sampled token's logprob and rank,
    # and the MAX_LOGPROBS best alternatives as (token_ids, logprobs). None otherwise.
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Speculative decoding: per row, every token the step emitted (accepted proposals, then one sampled token;
    # sampled_token_ids holds the first). The logprob lists then have ``logprobs_stride`` entries per row:
    # row r's j-th emitted token is entry r * logprobs_stride + j.
    emitted_token_ids: list[list[int]] | None = None
    logprobs_stride: int = 1
    # Per token of the step (numpy), for sequences with ``ScheduledSeq.prompt_logprobs``: a PromptLogprobs, else None.
    prompt_logprobs: Any = None

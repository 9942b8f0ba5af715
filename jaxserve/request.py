"""Request: one sequence's state as the scheduler sees it (no arrays, no JAX)."""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a set lookup: the loop asks every request several times a step, and hashing an
        # enum member runs Python code.
        self.finished: bool = value.startswith("finished_")

    @property
    def finish_reason(self) -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    """One sequence. With n > 1 the engine makes n Requests (one per sample) sharing the prompt.

    Token accounting: ``num_computed_tokens`` (tokens whose KV is in the cache or being written by a
    step in flight) moves towards ``num_tokens + num_pending_tokens``. A step schedules the difference
    or fewer; when a step reaches the last token, the token it samples is *pending* until the host
    reads it back (one step later under asynchronous scheduling), then it is appended.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        arrival_time: Optional[float] = None,
        lora_request=None,  # jaxserve.lora.LoRARequest, or None for the base model
        mm: Any = None,
    ) -> None:
        self.request_id = request_id
        self.lora_request = lora_request
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed  # resolved per-request RNG seed: same seed, same samples, whatever the batch
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled by dispatched steps whose ids the host has not read back yet (0, 1 or
        # transiently 2 under asynchronous scheduling). The next step can still compute them: the
        # runner feeds the sampled ids from the device (see ScheduledSeq.num_placeholders).
        self.num_pending_tokens = 0
        self.pending_row = -1  # this request's row in the last dispatched step that sampled for it
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks (prefix cache)
        # Speculative decoding: proposed next tokens for the next step to verify (set by the proposer after
        # each step, used up when scheduled).
        self.spec_token_ids: list[int] = []
        # Images of a vision-language prompt (jaxserve.multimodal.MultiModalInputs: content hashes, pixels,
        # placeholder offsets, M-RoPE rows), or None for text. Read by the runner and the prefix-cache hashes.
        self.mm = mm
        # With SamplingParams.prompt_logprobs (the first sample of a group only): jaxserve.prompt_logprobs.Rows,
        # filled as its prompt is computed. None: not wanted.
        self.prompt_logprobs = None
        # With SamplingParams.structured_outputs: this sample's jaxserve.structured_output.Grammar.
        self.grammar = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are wanted and some are still missing: admit it without prefix-cache hits."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.complete

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the request will have once its in-flight samples are read back."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` outputs: a stop string ended the request inside a step that
        emitted several tokens (speculative decoding), and the tokens after it are not part of the output."""
        cut = self.num_output_tokens - num_output_tokens
        if cut > 0:
            del self.output_token_ids[-cut:]
            del self.all_token_ids[-cut:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, {self.status.value})"
        )

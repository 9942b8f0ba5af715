"""The contract of an embedding request: its parameters in, its output out (vLLM's names)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """Per-request options of an embedding (``LLM.embed``, ``/v1/embeddings``).

    ``truncate_prompt_tokens``: None: a prompt longer than max_model_len is an error; k > 0: keep k tokens
    (text through the tokenizer's own truncation, which keeps special tokens such as [CLS]/[SEP]; token ids:
    the last k, as vLLM); -1: k = max_model_len. ``dimensions``: Matryoshka truncation (only for models
    trained for it). ``normalize``: None: as the checkpoint declares.
    """

    truncate_prompt_tokens: Optional[int] = None
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    n = 1  # one output per request: what the async engine's bookkeeping reads of a SamplingParams

    def __post_init__(self):
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(
                f"truncate_prompt_tokens={t!r} is invalid: must be a positive integer, or -1 for max_model_len"
            )
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions={d!r} is invalid: must be a positive integer")


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One finished embedding. ``outputs`` is None when the request was aborted (``finish_reason="abort"``)."""

    request_id: str
    outputs: Optional[EmbeddingOutput]
    prompt_token_ids: list[int]
    prompt: Optional[str] = None
    finished: bool = True
    finish_reason: str = "stop"  # "stop" | "abort"

    is_pooling = True  # the async engine and the metrics skip token accounting for these

"""Counters behind vLLM's speculative-decoding metrics (cumulative, like Prometheus counters)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodeStats:
    """``num_drafts``: verified sequences that had proposals; ``num_draft_tokens``: proposals verified;
    ``num_accepted_tokens``: of those, accepted; ``accepted_per_pos[j]``: drafts whose proposal j was accepted."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposals / verified proposals."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step of a sequence with proposals: 1 + accepted per draft (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def engine_stats(self) -> dict:
        """The EngineStats fields (jaxserve.llm_engine)."""
        return dict(
            spec_num_drafts=self.num_drafts, spec_num_draft_tokens=self.num_draft_tokens,
            spec_num_accepted_tokens=self.num_accepted_tokens, spec_accepted_per_pos=tuple(self.accepted_per_pos),
        )

    def summary(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate_per_pos": [round(a / self.num_drafts, 4) if self.num_drafts else 0.0
                                        for a in self.accepted_per_pos],
        }

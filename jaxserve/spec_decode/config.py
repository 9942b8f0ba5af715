"""SpeculativeConfig: vLLM's ``speculative_config`` dict, validated once into a frozen dataclass."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Union

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM spells the prompt-lookup method "ngram"; a draft model is picked by giving "model" (method "draft_model").
_KEYS = (
    "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "forced_acceptance_length",
    "quantization",
)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What proposes, and how many tokens per step."""

    method: str  # "ngram" | "draft_model" | "eagle" | "eagle3"
    num_speculative_tokens: int  # k: proposals scored per sequence per step
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram to look up (default 1)
    prompt_lookup_max: int = 3  # ngram: longest, tried first (default max(3, prompt_lookup_min))
    # draft_model: path of the draft checkpoint (same tokenizer as the target); eagle / eagle3: of the EAGLE head
    model: Optional[str] = None
    # Benchmarks only: every draft keeps min(this, its proposals) tokens whatever the target says, so the cost of
    # an acceptance length can be measured with dummy weights; "ngram" then pads its proposals to k (repeating the
    # last token), a proposer that costs nothing. The output is then NOT the model's.
    forced_acceptance_length: Optional[int] = None
    # draft_model: "fp8" quantizes the draft's weights (models/fp8_weights.py), halving the bytes each of its passes
    # reads; exact all the same (the target verifies every proposal). None: the draft in the target's dtype.
    quantization: Optional[str] = None

    @classmethod
    def parse(cls, value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From a dict, a JSON string (the CLI's ``--speculative-config``) or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"speculative_config={value!r} is not valid JSON ({e}); "
                    'e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
        return cls._from_dict(dict(value))

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        unknown = sorted(set(d) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known keys: {list(_KEYS)}")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r} is not supported: choose one of {METHODS}")
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k!r} is invalid: give an integer >= 1 (3 to 5 is typical)"
            )
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            lo = 1 if lo is None else lo
            hi = max(lo, 3) if hi is None else hi
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config {name}={v!r} is invalid: give an integer >= 1")
            if lo > hi:
                raise ValueError(
                    f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}: the minimum must not exceed "
                    "the maximum"
                )
        model = d.get("model")
        if method == "draft_model" and not model:
            raise ValueError(
                "speculative_config method='draft_model' needs 'model': the path of a smaller checkpoint with the "
                "target's tokenizer"
            )
        if method in ("eagle", "eagle3") and not model:
            raise ValueError(
                f"speculative_config method={method!r} needs 'model': the directory of an EAGLE head checkpoint "
                "trained for the target (config.json + weights)"
            )
        forced = d.get("forced_acceptance_length")
        if forced is not None and (not isinstance(forced, int) or not 0 <= forced <= k):
            raise ValueError(
                f"speculative_config forced_acceptance_length={forced!r} is invalid: give an integer in [0, "
                f"num_speculative_tokens={k}] (benchmarks only), or leave it out"
            )
        quantization = d.get("quantization")
        if quantization is not None and (method != "draft_model" or quantization != "fp8"):
            raise ValueError(
                f"speculative_config quantization={quantization!r} is invalid: only a draft model's weights are "
                "quantized, and only to \"fp8\" (e.g. {\"model\": \"path/to/draft\", \"quantization\": \"fp8\"}); "
                "leave it out otherwise"
            )
        return cls(method, k, lo or 1, hi or 3, model, forced, quantization)

"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxserve.structured_output import StructuredOutputsParams

# The most top-logprob alternatives a request may ask for; the sampler always computes this many.
MAX_LOGPROBS = 20
# The most tokens one request may bias (OpenAI's limit for logit_bias).
MAX_LOGIT_BIAS = 300


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping for one request. Validated on construction: bad values raise ValueError."""

    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0  # in [0, 1]
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 disables
    seed: Optional[int] = None
    stop: Optional[list[str] | str] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top alternatives besides the sampled token
    # Logprobs of the prompt's tokens (each given the tokens before it), with this many top alternatives each:
    # RequestOutput.prompt_logprobs. A request asking for them computes its whole prompt (no prefix-cache hits).
    prompt_logprobs: Optional[int] = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans a token, 100 all but
    # forces it). Logprobs stay those of the model's own distribution, as vLLM reports them.
    logit_bias: Optional[dict[int, float]] = None
    # Constrain the output to a JSON schema, any JSON object, a regex, a choice or a Lark grammar
    # (jaxserve.structured_output). A dict of StructuredOutputsParams's fields is accepted too.
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids; end-of-sequence tokens too, so leave them out
    # and the request runs to max_tokens). jaxserve.token_rules.
    allowed_token_ids: Optional[list[int]] = None
    # Words the output may not contain (vLLM's bad_words): a word's last token is banned after the rest of it.
    bad_words: Optional[list[str]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # "cumulative": an output after every step with everything so far (streaming, the server);
    # "final_only": only the finished output (LLM.generate), which spares the host a RequestOutput per
    # request per step.
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, value, want: str) -> ValueError:
            return ValueError(f"SamplingParams.{field}={value!r} is invalid: {want}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, v, "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 (or None for up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            self._validate_logit_bias(bad)
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        if self.output_kind not in ("cumulative", "final_only"):
            raise bad("output_kind", self.output_kind, "must be 'cumulative' or 'final_only'")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids (integers "
                      ">= 0)")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, (list, tuple)) or any(not isinstance(w, str) or not w.strip()
                                                                 for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "must be a list of words (non-blank strings)")

    def _validate_logit_bias(self, bad) -> None:
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", self.logit_bias, "must be a dict {token id: bias}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"<{len(self.logit_bias)} entries>", f"may bias at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise bad("logit_bias", {token: bias}, "keys must be token ids (integers >= 0)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", {token: bias}, "biases must be numbers in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_token_mask(self) -> bool:
        """The sampler masks this request's logits with a row built on the host: a structured-outputs grammar,
        allowed_token_ids or bad_words (each sample holds a structured_output.Grammar)."""
        return self.structured_outputs is not None or bool(self.allowed_token_ids) or bool(self.bad_words)

    @property
    def needs_host_tokens(self) -> bool:
        """The next step's sampler needs every token sampled so far on the host (penalties read the history, a
        token mask follows the tokens taken): the asynchronous loop reads the step in flight back first (for
        a mask, before launching the sampler only), and such a request does not speculate."""
        return self.uses_penalties or self.uses_token_mask

    @property
    def uses_filters(self) -> bool:
        """True when top-k / top-p / min-p cut the distribution (the sampler's sorting path)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

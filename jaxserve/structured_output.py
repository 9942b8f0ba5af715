"""Structured outputs: sampling constrained to a JSON schema, any JSON object, a regex, a choice of strings, or a
Lark grammar (``SamplingParams.structured_outputs``, vLLM's StructuredOutputsParams).

Each sample of such a request holds a grammar matcher on the host (``Grammar``; the llguidance library parses
the grammar and walks the tokenizer's vocabulary). Before a step samples the request's next token, the matcher
writes the tokens it allows into that row of a bitmask, 32 tokens an int32 word (``Grammar.fill``, through
``fill_token_masks``); the sampler sets every other logit to -inf (``sampler.apply_token_mask``). Once the
step is read back, the sampled token advances the matcher (``Grammar.accept``, from the scheduler's stop checks),
and a request whose grammar is complete stops there with finish_reason "stop", without spending a step on EOS.

A step's mask needs the token the step before it sampled, but only its sampler reads the mask: the asynchronous
loop launches the step's model first, then reads the step before back (advancing the matchers), fills the masks
and launches the sampler while the model runs (``ModelRunner.sample_deferred``). Logprobs stay those of the
model's own distribution, as vLLM reports them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional, Union

import numpy as np

from jaxserve import reasoning

logger = logging.getLogger("jaxserve")

# The kinds of constraint, in the order their fields are listed; a request sets exactly one.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (set exactly one of the first five fields).

    ``disable_any_whitespace`` (JSON only) differs from vLLM's default on purpose: JSON is written with
    ``json.dumps``'s separators (", " and ": ") and no other whitespace, because small models otherwise tend to
    fill their whole budget with newlines inside the object. Pass False to allow free whitespace between tokens.
    """

    json: Optional[Union[str, dict]] = None  # a JSON schema, as a dict or its JSON text
    regex: Optional[str] = None  # the whole output matches it (Rust regex syntax)
    choice: Optional[list[str]] = None  # the output is exactly one of these strings
    grammar: Optional[str] = None  # a Lark grammar (llguidance's dialect; its start rule is `start`)
    json_object: Optional[bool] = None  # any JSON object (OpenAI's response_format {"type": "json_object"})
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, value, want: str) -> ValueError:
            return ValueError(f"structured_outputs.{field}={_short(value)} is invalid: {want}")

        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(set_fields) if set_fields else 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise bad("json", self.json, f"is not valid JSON ({e})") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise bad("json", self.json, "must be a JSON schema (an object)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", self.regex, "must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):  # fmt: skip
            raise bad("choice", self.choice, "must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", self.grammar, "must be a non-empty Lark grammar")
        if self.json_object is not None and self.json_object is not True:
            raise bad("json_object", self.json_object, "must be true (or unset)")

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams":
        """A StructuredOutputsParams from itself or a dict of its fields (the server's JSON, vLLM's spelling)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured_outputs={_short(value)} is invalid: must be a dict with one of {', '.join(KINDS)}"
            )
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: {', '.join(KINDS)}, "
                "disable_any_whitespace"
            )
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar text."""
        import llguidance

        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's escapes
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        if self.grammar is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        schema = {"type": "object"} if self.json_object else self.json
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if not self.disable_any_whitespace:
            options = {"whitespace_flexible": True}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


class ReasoningGate:
    """Holds a reasoning model's structured output back until its reasoning is over (EngineArgs.reasoning_parser,
    jaxserve.reasoning): while the sample thinks, its matcher neither masks nor sees tokens; ``</think>`` hands the
    rest of the reply to it. A reply that may open with ``<think>`` (state "undecided") gets the grammar's tokens
    plus ``<think>`` for its first token: ``<think>`` starts reasoning, any other token was the grammar's own."""

    __slots__ = ("state", "start_id", "end_id")

    def __init__(self, state: str, start_id: int, end_id: int):
        self.state, self.start_id, self.end_id = state, start_id, end_id

    @property
    def thinking(self) -> bool:
        return self.state == reasoning.THINKING

    def take(self, token: int) -> bool:
        """Advance past a sampled token; True when the matcher must take it (the answer's tokens)."""
        if self.state == reasoning.UNDECIDED:
            self.state = reasoning.THINKING if token == self.start_id else reasoning.ANSWERING
        elif self.state == reasoning.THINKING and token == self.end_id:
            self.state = reasoning.ANSWERING
            return False
        return self.state == reasoning.ANSWERING

    def copy(self) -> "ReasoningGate":
        return ReasoningGate(self.state, self.start_id, self.end_id)


class Grammar:
    """One sample's token constraint: an llguidance matcher (structured outputs), ``token_rules.TokenRules``
    (allowed_token_ids, bad_words), or both. ``fill`` writes the tokens allowed next, ``accept`` takes a token.
    ``gate`` (a ReasoningGate, or None) keeps the matcher out of a reasoning model's reasoning; the rules apply
    throughout."""

    __slots__ = ("matcher", "words", "rules", "gate")

    def __init__(self, matcher, words: int, rules=None, gate: Optional[ReasoningGate] = None):
        self.matcher = matcher  # llguidance.LLMatcher, or None: the rules alone
        self.words = words  # int32 words of a mask row: ceil(vocabulary / 32)
        self.rules = rules  # token_rules.TokenRules, or None
        self.gate = gate

    @property
    def masks(self) -> bool:
        """Whether the matcher writes this sample's next mask (it has one, and no reasoning holds it back)."""
        return self.matcher is not None and (self.gate is None or not self.gate.thinking)

    def fill(self, mask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``mask[row]`` ([S, words] int32, bit t % 32 of word t // 32; a row
        without a matcher must arrive all-allowed)."""
        if self.masks:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(self.matcher, mask, row)
            self.open_reasoning(mask, row)
        if self.rules is not None:
            self.rules.apply(mask[row])

    def open_reasoning(self, mask: np.ndarray, row: int) -> None:
        """A reply that may still open with <think>: allow it beside the grammar's tokens."""
        if self.gate is not None and self.gate.state == reasoning.UNDECIDED:
            t = self.gate.start_id
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def accept(self, token: int) -> bool:
        """Advance past a sampled token. False: the request stops here (the grammar is complete, or refused it)."""
        if self.rules is not None:
            self.rules.accept(token)
        if self.matcher is None or (self.gate is not None and not self.gate.take(token)):
            return True
        if not self.matcher.consume_token(token):
            logger.warning("structured output: the grammar refused token %d (%s); stopping the request", token,
                           self.matcher.get_error())
            return False
        return not self.matcher.is_stopped()

    @property
    def ended(self) -> bool:
        """The grammar is complete or refused a token: its request has stopped."""
        return self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error())

    def copy(self) -> "Grammar":
        return Grammar(None if self.matcher is None else self.matcher.deep_copy(), self.words,
                       None if self.rules is None else self.rules.copy(),
                       None if self.gate is None else self.gate.copy())


class GrammarCompiler:
    """Per engine: llguidance's view of the tokenizer, built on first use (about a second for a 128k vocabulary),
    and the requests' matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which may exceed the tokenizer's
        self.eos_token_ids = list(eos_token_ids)
        self._lltokenizer = None

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for ``params``; ValueError naming the field when the constraint does not compile."""
        import llguidance

        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer: start the engine without "
                             "skip_tokenizer_init")
        if self._lltokenizer is None:
            import llguidance.hf

            self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=self.eos_token_ids or None)
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer, params.grammar_text())
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {e}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher.get_error()}")
        return Grammar(matcher, (self.vocab_size + 31) // 32)


_executor = None  # llguidance's thread pool for the masks of many rows at once (made on first use)


def token_masks(seqs, rows: list[int], num_rows: int, fill: bool = True) -> np.ndarray:
    """[S, W] int32 bitmask: the allowed tokens of each row in ``rows`` (sequences holding a grammar), every token
    allowed elsewhere (-1: all bits set). ``fill=False``: every token allowed everywhere, for ``fill_token_masks``
    to fill once the grammars have taken the tokens still in flight."""
    mask = np.full((num_rows, seqs[rows[0]].grammar.words), -1, np.int32)
    if fill:
        fill_token_masks(mask, seqs, rows)
    return mask


def fill_token_masks(mask: np.ndarray, seqs, rows: list[int]) -> None:
    """Write the allowed tokens of each row in ``rows`` into ``mask``. Several rows are filled in parallel on
    llguidance's own threads (it releases the GIL): 10-70 us a row on one core, which a batch of hundreds would
    otherwise pay in series. A grammar that has ended (its request finished on the token just read back; this
    row's sample will be dropped) is skipped: its row stays all-allowed."""
    global _executor
    live = [i for i in rows if not seqs[i].grammar.ended]
    matched = [i for i in live if seqs[i].grammar.masks]
    if len(matched) == 1:
        seqs[matched[0]].grammar.fill(mask, matched[0])  # its rules too, if any
    else:
        if matched:
            import llguidance
            from llguidance.numpy import fill_next_token_bitmask_par

            if _executor is None:
                _executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(_executor, [(seqs[i].grammar.matcher, i) for i in matched], mask)
        for i in matched:
            seqs[i].grammar.open_reasoning(mask, i)
            if seqs[i].grammar.rules is not None:
                seqs[i].grammar.rules.apply(mask[i])
    for i in live:
        # Rules alone, or a matcher held back by reasoning: the row is all-allowed until the rules apply.
        if not seqs[i].grammar.masks and seqs[i].grammar.rules is not None:
            seqs[i].grammar.rules.apply(mask[i])


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

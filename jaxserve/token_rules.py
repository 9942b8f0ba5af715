"""Per-request token rules that mask the sampler's logits: ``allowed_token_ids`` and ``bad_words`` (vLLM's names).

Both reach the sampler the way a structured-outputs grammar does: as a row of the step's token bitmask (32 tokens
an int32 word, bit t % 32 of word t // 32; ``sampler.apply_token_mask`` sets every other logit to -inf). A request
with either rule carries a ``structured_output.Grammar`` (with or without an llguidance matcher) whose ``fill``
ANDs the rules' bits into its row, and whose ``accept`` tells them each token taken. So the rules ride the same
asynchronous loop, deferred masks, preemption and speculation rules as a grammar, with no code of their own there.

- ``allowed_token_ids``: only these tokens may be sampled (end-of-sequence tokens included: with none of them in
  the list, a request runs to max_tokens), a fixed row built once.
- ``bad_words``: no output may contain these words. Each word is tokenized as it would start the text and as it
  would follow a space (a different token sequence in most vocabularies); a word's last token is banned whenever
  the tokens generated just before it spell the rest of that word. A one-token word is banned outright. Only
  generated tokens count, not the prompt's, as in vLLM.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask for a ``vocab_size``-wide logits row."""
    return (vocab_size + 31) // 32


def _bits(token_ids: Sequence[int], words: int) -> np.ndarray:
    """A bitmask row ([words] int32) with exactly these tokens' bits set."""
    row = np.zeros(words * 32, np.bool_)
    row[np.asarray(token_ids, np.int64)] = True
    return np.packbits(row.reshape(words, 32), axis=1, bitorder="little").view("<u4").reshape(words).view(np.int32)


class TokenRules:
    """One sample's allowed tokens and banned word sequences, and the tail of its output that the bans look at."""

    __slots__ = ("allowed", "sequences", "_tail", "_tail_len")

    def __init__(self, allowed: Optional[np.ndarray], sequences: tuple[tuple[int, ...], ...]):
        self.allowed = allowed  # [words] int32 bitmask row, or None: every token
        self.sequences = sequences  # token sequences whose last token is banned after the rest
        self._tail_len = max((len(s) for s in sequences), default=1) - 1
        self._tail: list[int] = []  # the last _tail_len tokens generated

    def apply(self, row: np.ndarray) -> None:
        """AND the rules into one bitmask row ([words] int32, in place)."""
        if self.allowed is not None:
            row &= self.allowed
        for seq in self.sequences:
            *before, last = seq
            if not before or (len(self._tail) >= len(before) and self._tail[-len(before):] == before):
                row[last >> 5] &= np.int32(~(1 << (last & 31)) if last & 31 != 31 else 0x7FFFFFFF)

    def accept(self, token: int) -> None:
        if self._tail_len:
            self._tail.append(token)
            del self._tail[: -self._tail_len]

    def copy(self) -> "TokenRules":
        twin = TokenRules(self.allowed, self.sequences)  # both are never written after construction
        twin._tail = list(self._tail)
        return twin


def bad_word_sequences(words: Sequence[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``bad_words``: each word as the text's start and after a space, without duplicates.
    A word whose spaced form only adds a separate space token is kept in its plain form alone (banning the space
    token would ban every space)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for seq in (plain, spaced):
            if seq and seq not in out and not (seq is spaced and len(spaced) > len(plain) and spaced[1:] == plain):
                out.append(seq)
    return tuple(out)


def build_token_rules(params, tokenizer, vocab_size: int) -> Optional[TokenRules]:
    """The rules of ``params`` (SamplingParams), or None when it sets neither field. ValueError naming the field when
    a token id is outside the vocabulary, or bad_words come without a tokenizer."""
    if not params.allowed_token_ids and not params.bad_words:
        return None
    allowed = None
    if params.allowed_token_ids:
        outside = next((t for t in params.allowed_token_ids if t >= vocab_size), None)
        if outside is not None:
            raise ValueError(f"allowed_token_ids=[..., {outside}, ...] is invalid: token id {outside} is outside the "
                             f"vocabulary [0, {vocab_size})")
        allowed = _bits(params.allowed_token_ids, mask_words(vocab_size))
    sequences: tuple[tuple[int, ...], ...] = ()
    if params.bad_words:
        if tokenizer is None:
            raise ValueError(f"bad_words={list(params.bad_words)!r} is invalid here: it needs the model's tokenizer "
                             "(start the engine without skip_tokenizer_init), or ban token ids with logit_bias -100")
        sequences = tuple(s for s in bad_word_sequences(params.bad_words, tokenizer) if all(t < vocab_size for t in s))
    return TokenRules(allowed, sequences)

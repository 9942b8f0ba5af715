"""`jaxserve bench spec-sweep` end to end on a tiny random model: one row per forced acceptance length 0..k,
each accepting exactly what it forces."""

from __future__ import annotations

import json

from tiny_models import make_tiny_checkpoint

from jaxserve.cli import main


def test_spec_sweep_rows_accept_what_they_force(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "sweep.json"
    rc = main(["bench", "spec-sweep", "--model", str(model), "--input-len", "12", "--output-len", "9", "--repeats",
               "1", "--max-model-len", "128", "--compilation-cache-dir", "", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 2}', "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["forced_acceptance_length"] for r in rows] == [0, 1, 2]
    assert all(r["draft_tokens"] > 0 and r["tok_s"] > 0 for r in rows)
    assert rows[0]["accepted_tokens"] == 0  # forced 0: every proposal rejected
    assert rows[2]["accepted_tokens"] == rows[2]["draft_tokens"]  # forced k: every proposal accepted
    # Each verify step emits a + 1 tokens: 9 tokens take fewer steps the more are accepted.
    assert rows[2]["runs"][0]["steps"] < rows[0]["runs"][0]["steps"]

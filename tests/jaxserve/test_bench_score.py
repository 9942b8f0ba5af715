"""`jaxserve bench score` end to end on a tiny checkpoint, HF side included: both sides score the same prompts,
and in float32 their per-prompt logprob sums agree."""

from __future__ import annotations

import json

from engine_fixtures import checkpoint, run_cache_dir

from jaxserve.cli import main


def test_bench_score_reports_both_sides_and_they_agree(tmp_path):
    out = tmp_path / "result.json"
    rc = main(["bench", "score", "--model", checkpoint("llama_gqa"), "--dtype", "float32", "--num-prompts", "6",
               "--input-len", "40", "--k", "2", "--compare-hf", "--hf-batch-size", "4", "--max-model-len", "128",
               "--max-num-batched-tokens", "32", "--compilation-cache-dir", run_cache_dir(), "--precompile", "none",
               "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens_per_s"] > 0 and result["hf"]["prompt_tokens_per_s"] > 0
    assert result["prompt_tokens"] == result["hf"]["prompt_tokens"]
    assert len(result["logprob_sums"]) == 6
    assert result["max_rel_logprob_sum_diff"] < 1e-4

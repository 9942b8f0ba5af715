"""`jaxserve bench structured` end to end on a tiny checkpoint: every record fits the schema, and the unconstrained
run generates exactly as many tokens; the forced tool calls' grammar timing (bench.tool_grammar)."""

from __future__ import annotations

import json

from engine_fixtures import checkpoint, run_cache_dir

from jaxserve.bench.structured import fits
from jaxserve.cli import main


def test_bench_structured_reports_both_runs(tmp_path):
    out = tmp_path / "result.json"
    rc = main(["bench", "structured", "--model", checkpoint("llama_gqa"), "--dtype", "float32", "--num-prompts", "4",
               "--input-len", "20", "--max-model-len", "256", "--max-num-batched-tokens", "64",
               "--compilation-cache-dir", run_cache_dir(), "--precompile", "none", "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["valid_outputs"] == 4 and result["finish_reasons"] == {"stop": 4, "length": 0}
    assert result["constrained_tokens_per_s"] > 0 and result["unconstrained_tokens_per_s"] > 0
    assert fits(result["example"]) and result["jax"] and result["engine_args"]["dtype"] == "float32"


def test_bench_structured_prices_the_token_rules(tmp_path):
    for constraint in ("bad_words", "allowed_token_ids"):
        out = tmp_path / f"{constraint}.json"
        rc = main(["bench", "structured", "--model", checkpoint("llama_gqa"), "--dtype", "float32", "--num-prompts",
                   "3", "--input-len", "20", "--max-model-len", "256", "--max-tokens", "8", "--constraint", constraint,
                   "--compilation-cache-dir", run_cache_dir(), "--precompile", "none", "--output-json", str(out)])  # fmt: skip
        assert rc == 0
        result = json.loads(out.read_text())
        assert result["constraint"] == constraint and result["output_tokens"] == 24
        assert result["finish_reasons"] == {"stop": 0, "length": 3} and result["valid_outputs"] is None


def test_fits_checks_every_field():
    good = '{"name": "a", "age": 3, "role": "admin", "email": "b", "tags": ["x"]}'
    assert fits(good)
    assert not fits(good.replace('"admin"', '"root"')) and not fits(good[:-1]) and not fits('{"name": "a"}')


def test_tool_grammar_bench_times_each_choice(tmp_path):
    from jaxserve.bench import tool_grammar

    out = tmp_path / "tools.json"
    assert tool_grammar.main(["--tools", "1,2", "--out", str(out)]) == 0  # the default model's tokenizer
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tool_choice"], r["tools"]) for r in rows] == [("required", 1), ("named", 1), ("required", 2),
                                                              ("named", 2)]
    assert all(r["compile_ms"] > 0 and r["first_mask_ms"] > 0 for r in rows)

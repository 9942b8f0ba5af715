"""`jaxserve bench embed` end to end on a tiny config-only BERT (dummy weights), HF side included."""

from __future__ import annotations

import json

from jaxserve.bench.embed import workload
from jaxserve.cli import main


def test_bench_embed_reports_both_sides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["BertModel"], model_type="bert", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=2000, max_position_embeddings=64,
    )))  # fmt: skip
    out = tmp_path / "result.json"
    rc = main(["bench", "embed", "--model", str(tmp_path), "--load-format", "dummy", "--num-prompts", "12",
               "--min-len", "4", "--max-len", "40", "--compare-hf", "--hf-batch-size", "4", "--compilation-cache-dir",
               "", "--precompile", "none", "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["engine_info"]["runner"] == "pooling"
    assert result["embeddings_per_s"] > 0 and result["hf"]["embeddings_per_s"] > 0 and result["speedup_vs_hf"] > 0
    assert result["tokens"] == sum(len(p) for p in workload(12, 4, 40, 2000))


def test_workload_lengths_span_the_range():
    prompts = workload(200, 8, 128, 30522)
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 8 and max(lengths) <= 128 and max(lengths) - min(lengths) > 100

"""`jaxserve bench vl` on the tiny Qwen2-VL, quickly: one jaxserve row and one HF row run in this process (the
command runs each in a child process), then the table and speed-ups the command prints."""

from __future__ import annotations

import json
import os
import shutil

from engine_fixtures import run_cache_dir
from tiny_qwen2_vl import tiny_qwen2_vl

from jaxserve.bench import hf_vl_generate, vl

WORKLOAD = dict(num_prompts=3, input_len=6, image_size=56, output_len=3)


def test_rows_and_table(tmp_path):
    """The jaxserve row on dummy weights from the config alone (as on the GPU), the HF row on the checkpoint."""
    spec, res = tmp_path / "spec.json", tmp_path / "res.json"
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(os.path.join(tiny_qwen2_vl(), "config.json"), config_only)
    engine_args = vl.row_settings("fp32", dict(model=str(config_only), load_format="dummy", max_model_len=64, max_num_batched_tokens=16,
                                               max_num_seqs=1,  # two step shapes: a 16-token prefill, a decode
                                               block_size=4, compilation_cache_dir=run_cache_dir(), precompile="none"))
    spec.write_text(json.dumps({"engine_args": engine_args, "workload": WORKLOAD}))
    vl.child_main(str(spec), str(res))
    ours = json.loads(res.read_text())
    assert ours["output_tokens"] == 3 * 3 and ours["images_encoded"] == 3 and ours["dtype"] == "float32"
    assert ours["lazy_compiles_timed"] == 0  # the warm-up pass compiled every shape the timed run reaches

    spec.write_text(json.dumps({"model": tiny_qwen2_vl(), "dtype": "float32", "batch_sizes": [2, 3], "workload": WORKLOAD}))
    hf_vl_generate.main(str(spec), str(res))
    hf = json.loads(res.read_text())
    assert [t["batch_size"] for t in hf["tries"]] == [2, 3] and hf["output_tokens"] == 9

    rows = [{"row": "hf-fp32", "note": "", **hf}, {"row": "fp32", "note": "", **ours}, {"row": "bf16", "note": "", "error": "x"}]
    vl._speedups(rows)
    assert rows[1]["speedup_vs_hf_same_dtype"] == ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    table = vl.format_table(rows)
    assert "| fp32 |" in table and "failed: x" in table
    assert vl.row_settings("bf16-eager", {"dtype": "auto"}) == {"dtype": "bfloat16", "enforce_eager": True}


def test_eager_row_names_its_shorter_workload():
    """A scaled eager row (--eager-scale) says in the table how many tokens it made, so no one reads it as the full run."""
    rows = [{"row": "bf16-eager", "note": "eager", "dtype": "bfloat16", "output_tokens_per_s": 10.0, "requests_per_s": 1.0,
             "output_len": 16}]  # fmt: skip
    assert "eager (16 new tokens a request)" in vl.format_table(rows)

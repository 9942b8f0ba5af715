"""Issue 11's benches: roofline arithmetic, the 8B-shape directory's tokenizer, server flags, and each new
command end to end on the tiny model (`bench latency`, `bench ablation`, `bench suite`), writing JSON and PNGs.
No timing is asserted: speeds are the benches' output, not the tests'."""

import json
from pathlib import Path

import pytest
import torch
from engine_fixtures import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from jaxserve.bench import ablation, roofline, suite
from jaxserve.bench.launch import engine_flags
from jaxserve.bench.model_shapes import write_shape, write_word_tokenizer
from jaxserve.bench.workload import BenchRequest
from jaxserve.cli import build_parser, engine_args_from
from jaxserve.config import EngineArgs
from jaxserve.model_loader import read_text_config

# Tiny sizes shared by the end-to-end runs: a 64-token context, 4 sequences, a 32-token step.
ENGINE = ["--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
          "--block-size", "4"]


def test_param_count_matches_transformers():
    path = checkpoint("llama_gqa")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    assert roofline.param_counts(read_text_config(path))["total"] == sum(p.numel() for p in hf.parameters())


def test_8b_shape_dir_and_its_tokenizer(tmp_path):
    write_shape("llama3-8b", str(tmp_path), num_hidden_layers=2)
    cfg = read_text_config(str(tmp_path))
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 4096
    # 2 layers of 218.1M matmul weights + norms, embeddings and LM head of 525.3M each (bf16: 2 bytes each).
    assert roofline.weight_bytes(cfg, "bfloat16") == 2 * (2 * (218_103_808 + 8192) + 2 * 525_336_576 + 4096)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == cfg.vocab_size
    ids = tok.encode("the time of w5000", add_special_tokens=False)
    assert len(ids) == 4 and tok.decode(ids) == "the time of w5000"
    assert all(tok.decode([i]).strip() for i in (7, 128000, 128255))  # every id decodes to something
    # As save_pretrained writes it (transformers 5.0-5.17 warn about a "Mistral regex" without it).
    assert json.loads((tmp_path / "config.json").read_text())["transformers_version"]


def test_offline_roofline_counts():
    cfg = read_text_config(checkpoint("llama_gqa"))
    rates = {"copy_bytes_per_s": 1e9, "matmul_flops_per_s": 1e12}
    work = [BenchRequest([5] * 3, 2)]  # positions 0..3 computed (3 prompt + 1 decode), 2 tokens sampled
    roof = roofline.offline(cfg, "float32", work, max_num_seqs=4, max_num_batched_tokens=32, rates=rates)
    pc = roofline.param_counts(cfg)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * (1 + 2 + 3 + 4)
    assert roof["flops"] == 2 * pc["layer_matmul"] * cfg.num_hidden_layers * 4 + 2 * pc["lm_head"] * 2 + attn
    assert roof["min_steps"] == 2  # one prefill step, one decode step
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert roof["bytes"] == 2 * roofline.weight_bytes(cfg, "float32") + kv * (4 + 4)  # decode reads 4, writes 4
    assert roof["seconds"] == max(roof["flops_s"], roof["bytes_s"])
    # The serial bound: matmuls (here memory-bound: 2 steps of weights at 1 GB/s), then the KV traffic.
    assert roof["kv_bytes"] == kv * 8 and roof["serial_seconds"] == pytest.approx(
        max(roof["flops_s"], 2 * roofline.weight_bytes(cfg, "float32") / 1e9) + kv * 8 / 1e9)
    assert roof["serial_output_tokens_per_s"] <= roof["output_tokens_per_s"]


def test_engine_flags_rebuild_the_same_args():
    args = EngineArgs(model="m", dtype="float32", enable_chunked_prefill=False, max_model_len=64,
                      enforce_eager=True, gpu_memory_utilization=0.5)
    flags = engine_flags(args)
    assert "--no-enable-chunked-prefill" in flags and "--enforce-eager" in flags
    assert engine_args_from(build_parser().parse_args(["serve", *flags])) == args


def test_bad_flags_name_themselves():
    with pytest.raises(ValueError, match=r"--rows='hf,turbo' is invalid"):
        ablation.parse_rows("hf,turbo")
    assert ablation.parse_rows("default,hf") == ["hf", "default"]
    with pytest.raises(ValueError, match=r"--parts='x' is invalid"):
        suite._parts("x")
    with pytest.raises(ValueError, match=r"--serve-concurrency='0' is invalid"):
        suite._concurrencies("0")


def test_no_chunked_prefill_row_raises_a_small_step_budget():
    base = {"max_num_batched_tokens": 32, "max_model_len": 64}
    args, _ = ablation.row_settings("no-chunked-prefill", base, {}, 1.0)
    assert args["max_num_batched_tokens"] == 64 and args["enable_chunked_prefill"] is False
    _, work = ablation.row_settings("eager", base, {"input_len": 512, "output_len": 256}, 0.125)
    assert (work["input_len"], work["output_len"]) == (64, 32)


def test_fp32_rows_compare_with_hf_in_float32():
    rows = [{"row": "hf", "dtype": "bfloat16", "output_tokens_per_s": 100.0},
            {"row": "hf-fp32", "dtype": "float32", "output_tokens_per_s": 40.0},
            {"row": "fp32", "dtype": "float32", "output_tokens_per_s": 80.0},
            {"row": "default", "dtype": "bfloat16", "output_tokens_per_s": 500.0},
            {"row": "eager", "error": "timed out"}]
    ablation.add_speedups(rows)
    assert rows[2]["speedup_vs_hf"] == 0.8 and rows[2]["speedup_vs_hf_same_dtype"] == 2.0
    assert rows[3]["speedup_vs_hf"] == rows[3]["speedup_vs_hf_same_dtype"] == 5.0
    assert "speedup_vs_hf_same_dtype" not in rows[1] and "speedup_vs_hf" not in rows[4]
    assert ablation.parse_rows("hf-fp32,hf") == ["hf", "hf-fp32"]


def test_ablation_reuses_the_rows_an_earlier_ablation_finished(tmp_path):
    work = {"num_prompts": 4, "input_len": 8, "output_len": 4, "range_ratio": 0.0}
    scaled = {**work, "input_len": 1, "output_len": 2}
    earlier = {"workload": work, "engine_args": {"model": "m"}, "eager_scale": 0.125, "rows": [
        {"row": "hf", "dtype": "bfloat16", "batch_size": 64, "output_tokens_per_s": 10.0, "workload": work},
        {"row": "eager", "dtype": "bfloat16", "output_tokens_per_s": 2.0, "workload": scaled},
        {"row": "fp32", "error": "timed out after 200 s", "workload": work}]}
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps(earlier))
    rows = ablation._reusable(str(path), work, {"model": "m"}, 0.125)
    assert set(rows) == {"hf", "eager"}  # a failed row is run again
    assert rows["eager"]["workload"] == scaled and rows["hf"]["batch_size"] == 64
    with pytest.raises(ValueError, match="--eager-scale 0.125"):
        ablation._reusable(str(path), work, {"model": "m"}, 0.5)
    with pytest.raises(ValueError, match="workload"):
        ablation._reusable(str(path), {**work, "num_prompts": 8}, {"model": "m"}, 0.125)
    with pytest.raises(ValueError, match="engine flags"):
        ablation._reusable(str(path), work, {"model": "other"}, 0.125)


def test_a_killed_row_says_how_far_its_child_got(monkeypatch):
    import subprocess

    from jaxserve.bench import sweep

    def killed(cmd, timeout, **kw):
        err = (b"Loading weights 100%\rbench child: building the engine (loading weights, compiling step shapes)\n"
               b"Compiling step shapes:  40%|####      | 20/51\r")
        raise subprocess.TimeoutExpired(cmd, timeout, output=None, stderr=err)

    monkeypatch.setattr(subprocess, "run", killed)
    row = sweep._run_child({}, {}, 200.0)
    assert row["error"] == "timed out after 200s (building the engine (loading weights, compiling step shapes))"
    assert sweep._last_phase("", None) == ""


def _run(argv):
    ns = build_parser().parse_args(argv)
    assert ns.func(ns) == 0


def test_latency(tmp_path):
    # HF's single stream is covered by the suite's offline part (the same code path).
    out = tmp_path / "lat.json"
    _run(["bench", "latency", "--model", checkpoint("llama_gqa"), *ENGINE, "--compilation-cache-dir", str(tmp_path / "cc"),
          "--input-len", "8", "--output-len", "6", "--repeats", "2", "--quick", "--output-json", str(out),
          "--trace-dir", str(tmp_path / "trace")])
    res = json.loads(out.read_text())
    assert res["repeats"] == 2 and len(res["runs_tokens_per_s"]) == 2
    assert res["tokens_per_s"] > 0 and res["roofline"]["tokens_per_s"] > 0 and res["roofline_fraction"] > 0
    assert res["trace"]["host_top"]  # one more request, traced (jaxserve.bench.trace)


def test_suite_offline_and_serving(tmp_path):
    # As on the GPU: a config-only directory with model_shapes' word tokenizer, dummy weights in jaxserve
    # and random ones in HF (the numbers differ: only the speeds are compared), text prompts to the server.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((Path(checkpoint("llama_gqa")) / "config.json").read_text())
    write_word_tokenizer(str(model), 512, bos_id=0, eos_id=1)
    _run(["bench", "suite", "--model", str(model), "--load-format", "dummy", *ENGINE, "--compilation-cache-dir", str(tmp_path / "cc"),
          "--num-prompts", "4", "--input-len", "12", "--output-len", "4", "--single-stream-input-len", "8",
          "--single-stream-output-len", "6", "--single-stream-repeats", "2", "--serve-concurrency", "1,2",
          "--serve-prompts-per-slot", "2", "--hf-batch-size", "2", "--quick", "--timeout", "300",
          "--output-dir", str(tmp_path)])
    res = json.loads((tmp_path / "suite.json").read_text())
    off = res["parts"]["offline"]
    assert off["output_tokens_per_s"] > 0 and off["roofline_fraction"] > 0 and off["speedup_vs_hf"] > 0
    assert off["single_stream"]["hf"]["tokens_per_s"] > 0
    runs = res["parts"]["serve"]["runs"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    assert all(r["completed"] == 2 * r["concurrency"] and r["failed"] == 0 for r in runs)
    goals = {g["metric"]: g for g in res["goals"]}
    assert goals["offline_output_tokens_per_s"]["measured"] == off["output_tokens_per_s"]
    assert goals["serve_c64_output_tokens_per_s"]["measured"] is None  # concurrency 64 was not run
    assert (tmp_path / "suite.png").stat().st_size > 1000

    # The ablation takes HF and default from that offline run; only the eager row runs (scaled workload).
    _run(["bench", "ablation", "--model", str(model), "--load-format", "dummy", *ENGINE,
          "--compilation-cache-dir", str(tmp_path / "cc"), "--num-prompts", "4", "--input-len", "12", "--output-len", "4",
          "--range-ratio", "0.0", "--rows", "eager,hf,default", "--reuse", str(tmp_path / "offline.json"),
          "--eager-scale", "0.5", "--timeout", "300", "--output-dir", str(tmp_path / "ablation")])
    abl = json.loads((tmp_path / "ablation" / "ablation.json").read_text())
    rows = {r["row"]: r for r in abl["rows"]}
    assert list(rows) == ["hf", "eager", "default"]
    assert rows["hf"]["reused_from"] and rows["default"]["output_tokens_per_s"] == off["output_tokens_per_s"]
    assert "reused_from" not in rows["eager"] and rows["eager"]["workload"]["output_len"] == 2
    assert all(r["speedup_vs_hf"] > 0 for r in rows.values())
    assert (tmp_path / "ablation" / "ablation.png").stat().st_size > 1000
    # A later suite call in the same directory summarises what is already there.
    assert len(suite._earlier_result(str(tmp_path), "serve")["runs"]) == 2
    assert suite._earlier_result(str(tmp_path), "ablation")["rows"][1]["row"] == "eager"


def test_suite_reuses_offline_only_when_it_measured_the_same(tmp_path):
    path = tmp_path / "offline.json"
    work, args = {"num_prompts": 4}, {"model": "m"}
    path.write_text(json.dumps({"workload": work, "engine_args": args, "hf": {}}))
    assert suite._reusable_offline(str(path), work, args, need_hf=True)
    assert not suite._reusable_offline(str(path), {"num_prompts": 8}, args, need_hf=True)
    assert not suite._reusable_offline(str(path), work, {"model": "other"}, need_hf=False)
    assert not suite._reusable_offline(str(tmp_path / "missing.json"), work, args, need_hf=False)

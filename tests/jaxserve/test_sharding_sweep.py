"""`jaxserve bench sweep`: flag parsing, which layouts fit, the tables and the plot; and one small real sweep
(two layouts of the tiny model, offline and serving phases, each in its own child process)."""

import json

import jax
import pytest
from engine_fixtures import checkpoint, run_cache_dir

from jaxserve.bench import sweep
from jaxserve.cli import build_parser

STATS = {"mean": 1.0, "p50": 1.0, "p99": 2.0}
SERVE = {"concurrency": 4, "output_tokens_per_s": 50.0, "requests_per_s": 1.5, "request_output_tokens_per_s": STATS,
         "ttft_ms": {"mean": 120.0, "p50": 110.0, "p99": 300.0}, "itl_ms": {"mean": 20.0, "p50": 18.0, "p99": 40.0},
         "failed": 0}


def test_int_list_and_skip_reasons():
    assert sweep._int_list("tp", "4,2,1") == [4, 2, 1]
    with pytest.raises(ValueError, match=r"--dp='0,x' is invalid"):
        sweep._int_list("dp", "0,x")
    assert sweep._skip_reason(4, 4, 8, (8, 8)) == "needs 16 devices, 8 present"
    assert "does not divide" in sweep._skip_reason(4, 1, 8, (8, 2))
    assert sweep._skip_reason(2, 4, 8, (8, 2)) is None


def test_serve_flags_are_checked_before_any_child_starts():
    ns = build_parser().parse_args(["bench", "sweep", "--serve-concurrency", "0"])
    with pytest.raises(ValueError, match=r"--serve-concurrency=0 is invalid"):
        sweep._serve_workload(ns, {})
    ns = build_parser().parse_args(["bench", "sweep", "--skip-tokenizer-init"])
    with pytest.raises(ValueError, match=r"--no-serve"):
        sweep._serve_workload(ns, {"skip_tokenizer_init": True})
    assert build_parser().parse_args(["bench", "sweep", "--no-serve"]).serve is False


def test_tables_and_plot(tmp_path):
    ok = {"tp": 2, "dp": 1, "output_tokens_per_s": 100.0, "requests_per_s": 2.0, "latency_s": STATS,
          "ttft_s": STATS, "tpot_s": STATS, "serve": SERVE}
    failed_serving = {**ok, "tp": 1, "serve": {"error": "RuntimeError: boom"}}
    rows = [ok, failed_serving, {"tp": 4, "dp": 4, "skipped": "needs 16 devices, 8 present"}]
    table = sweep.format_table(rows)
    assert "| 2 | 1 | 2 | 100.0 | 2.00 | 1.00 / 2.00 |" in table and "needs 16 devices" in table
    serving = sweep.format_serving_table(rows)
    assert "| 2 | 1 | 4 | 50.0 | 1.50 | 1.0 / 1.0 / 2.0 | 120 / 110 / 300 | 20.0 / 18.0 / 40.0 | 0 |" in serving
    assert "RuntimeError: boom" in serving and "needs 16 devices" in serving
    pytest.importorskip("matplotlib")
    out = tmp_path / "s.png"
    assert sweep.plot({"configs": rows, "device": "cpu", "num_devices": 8, "date": "today"}, str(out))
    assert out.stat().st_size > 1000


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_small_sweep_runs_offline_and_serving_phases(tmp_path):
    out = tmp_path / "sweep.json"
    ns = build_parser().parse_args([
        "bench", "sweep", "--tp", "1", "--dp", "1,2", "--model", checkpoint("llama_gqa"), "--dtype", "float32",
        "--num-prompts", "4", "--input-len", "12", "--output-len", "4", "--range-ratio", "0",
        "--serve-num-prompts", "4", "--serve-concurrency", "2", "--max-model-len", "64",
        "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--block-size", "4", "--compilation-cache-dir", run_cache_dir(),
        "--timeout", "300", "--output-json", str(out), "--output-png", "",
    ])
    assert ns.func(ns) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["serve"]["concurrency"] == 2
    for row in result["configs"]:
        assert "error" not in row, row
        serve = row["serve"]
        assert "error" not in serve, serve
        assert serve["completed"] == 4 and serve["failed"] == 0
        assert serve["peak_concurrent_requests"] <= 2
        # ITL may read 0 on a loaded machine: a slow reader gets several tokens in one streamed chunk.
        assert serve["output_tokens_per_s"] > 0 and serve["ttft_ms"]["p50"] > 0 and serve["itl_ms"]["mean"] >= 0
    assert [(r["tp"], r["dp"]) for r in result["configs"]] == [(1, 1), (1, 2)]

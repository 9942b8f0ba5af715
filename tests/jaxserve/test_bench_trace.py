"""`jaxserve.bench.trace`: a Perfetto trace summarized per device (kernels, busy time against span) and host
(launch waits), on a hand-made trace with device events and on a real CPU trace of a bench."""

from __future__ import annotations

import gzip
import json

import pytest
from engine_fixtures import run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve.bench import trace
from jaxserve.cli import main


def _write(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_summary_of_device_kernels_and_launch_waits(tmp_path):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    kernels = [  # two streams: [0, 10) and [5, 12) overlap, then a gap, then [20, 30)
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10, "name": "gemm"},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 5, "dur": 7, "name": "attention"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 20, "dur": 10, "name": "gemm"},
    ]
    host = [
        {"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 4000, "name": "Wait for donation holds"},
        {"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 500, "name": "ExecutePrepare"},
        {"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 9999, "name": "$profiler.py:1 trace"},  # the profiler's own
    ]
    _write(tmp_path / "x.trace.json.gz", meta + kernels + host)
    s = trace.summarize(str(tmp_path))
    gpu = s.devices["/device:GPU:0"]
    assert gpu["span_ms"] == pytest.approx(0.030) and gpu["busy_ms"] == pytest.approx(0.022)  # 12 + 10 us
    assert gpu["kernels"][0] == ("gemm", pytest.approx(0.020), 2)
    assert s.launch_waits == [("Wait for donation holds", pytest.approx(4.0), 1)]
    assert [name for name, _, _ in s.host_top] == ["Wait for donation holds", "ExecutePrepare"]
    text = trace.format_summary(s)
    assert "busy 0.02 of 0.03 ms (73%)" in text and "Wait for donation holds" in text


def test_missing_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz under"):
        trace.summarize(str(tmp_path))


def test_spec_sweep_traces_a_request_per_row(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "sweep.json"
    rc = main(["bench", "spec-sweep", "--model", str(model), "--input-len", "12", "--output-len", "6", "--repeats",
               "1", "--max-model-len", "128", "--compilation-cache-dir", run_cache_dir(), "--acceptance", "2", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 2}', "--output-json", str(out),
               "--trace-dir", str(tmp_path / "tr")])  # fmt: skip
    assert rc == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["trace"]["host_top"]  # a CPU trace: XLA's work shows as host events
    assert list((tmp_path / "tr" / "a2").rglob("*.trace.json.gz"))
    assert "host, largest events:" in capsys.readouterr().out


def test_throughput_traces_a_window_of_steps(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "tp.json"
    base = ["bench", "throughput", "--model", str(model), "--num-prompts", "3", "--input-len", "12", "--output-len",
            "6", "--max-model-len", "128", "--compilation-cache-dir", run_cache_dir(), "--precompile", "none"]  # fmt: skip
    rc = main([*base, "--output-json", str(out), "--trace-dir", str(tmp_path / "tr"), "--trace-steps", "2:3"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["trace"]["steps"] == [2, 3] and res["trace"]["host_top"]
    # A window past the run's end: the exit status says so, and the timed numbers are written all the same.
    out2 = tmp_path / "tp2.json"
    assert main([*base, "--output-json", str(out2), "--trace-dir", str(tmp_path / "tr2"), "--trace-steps", "1000:5"]) != 0
    assert "never started: lower the first step of --trace-steps" in capsys.readouterr().err
    res2 = json.loads(out2.read_text())
    assert res2["output_tokens"] == res["output_tokens"] and "never started" in res2["trace"]["error"]


def test_bad_window_is_named():
    assert trace.parse_window("100:20") == (100, 20)
    for bad in ("100", "a:b", "5:0", "-1:3"):
        with pytest.raises(ValueError, match="--trace-steps=.* FIRST:COUNT"):
            trace.parse_window(bad)

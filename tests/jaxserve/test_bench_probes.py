"""Smoke tests of small benches on CPU: the weight-only GEMV probe, the CPU one-row product forms (tiny
widths) and few-row products, and the first-requests timer (a tiny target with an n-gram speculator, primed or not; on CPU nothing
is primed either way)."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import checkpoint

from jaxserve.bench import cpu_gemm_rows, cpu_gemv_forms, first_requests, weight_only_gemv


def test_weight_only_gemv_quick(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert weight_only_gemv.main(["--quick", "--kinds", "bf16,int8,fp8", "--rows", "1,2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["rows"]) for r in rows] == [(k, m) for k in ("bf16", "int8", "fp8") for m in (1, 2)]
    assert all(r["ms"] > 0 and r["weight_gb"] > 0 for r in rows)
    assert rows[2]["weight_gb"] < rows[0]["weight_gb"]  # int8 weights: about half the bytes


def test_cpu_gemv_forms_quick(tmp_path, capsys):
    out = tmp_path / "forms.json"
    assert cpu_gemv_forms.main(["--quick", "--layer-forms", "NNNN,TNNT", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["form"] for r in res["rows"]] == list(cpu_gemv_forms.FORMS)
    exact = {r["form"]: r["rel_err"] for r in res["rows"]}
    assert exact["f32"] == 0 and exact["f32_t"] < 1e-5  # the same float32 product, stored either way
    assert max(exact.values()) < 0.05  # int8 and bf16 weights: close, not exact
    assert [r["layer_forms"] for r in res["layer_rows"]] == ["NNNN", "TNNT"]


def test_cpu_gemm_rows_quick(tmp_path, capsys):
    from jaxserve.pallas_kernels import cpu_native

    out = tmp_path / "rows.json"
    assert cpu_gemm_rows.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [2, 8]
    ways = {"xla", "native"} if cpu_native.loaded("gemm") else {"xla"}
    assert all(set(r) - {"rows"} == ways and all(r[w]["ms"] > 0 for w in ways) for r in rows)
    assert cpu_gemm_rows.main(["--quick", "--quantized", "--out", str(out)]) == 0  # block-quantized weights too
    if cpu_native.loaded("qgemm"):
        ways |= {"codes", "codes_dequantized"}
    assert all(set(r) - {"rows"} == ways for r in json.loads(out.read_text())["rows"])


def test_cpu_gemm_rows_rejects_bad_rows(capsys):
    with pytest.raises(SystemExit):
        cpu_gemm_rows.main(["--rows", "16,x"])
    assert "--rows='16,x'" in capsys.readouterr().err


def test_cpu_gemv_forms_rejects_a_bad_form(capsys):
    with pytest.raises(SystemExit):
        cpu_gemv_forms.main(["--quick", "--forms", "f32,int4"])
    assert "unknown form 'int4'" in capsys.readouterr().err


def test_first_requests_reports_the_first_against_the_steady(tmp_path, capsys):
    out = tmp_path / "first.jsonl"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    argv = ["--model", checkpoint("llama_gqa"), "--requests", "3", "--input-len", "8", "--output-len", "4",
            "--max-model-len", "64", "--precompile", "none", "--speculative-config", spec, "--out", str(out)]
    assert first_requests.main([*argv, "--unprimed-speculation"]) == 0
    row = json.loads(out.read_text().splitlines()[-1])
    assert len(row["request_s"]) == 3 and row["primed_speculation"] is False and row["startup_s"] > 0

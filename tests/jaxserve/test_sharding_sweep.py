"""`jaxserve bench sweep`'s pure parts: flag parsing, which layouts fit, the table and the plot."""

import pytest

from jaxserve.bench import sweep


def test_int_list_and_skip_reasons():
    assert sweep._int_list("tp", "4,2,1") == [4, 2, 1]
    with pytest.raises(ValueError, match=r"--dp='0,x' is invalid"):
        sweep._int_list("dp", "0,x")
    assert sweep._skip_reason(4, 4, 8, (8, 8)) == "needs 16 devices, 8 present"
    assert "does not divide" in sweep._skip_reason(4, 1, 8, (8, 2))
    assert sweep._skip_reason(2, 4, 8, (8, 2)) is None


def test_table_and_plot(tmp_path):
    stats = {"mean": 1.0, "p50": 1.0, "p99": 2.0}
    ok = {"tp": 2, "dp": 1, "output_tokens_per_s": 100.0, "requests_per_s": 2.0, "latency_s": stats,
          "ttft_s": stats, "tpot_s": stats}
    rows = [ok, {"tp": 4, "dp": 4, "skipped": "needs 16 devices, 8 present"}]
    table = sweep.format_table(rows)
    assert "| 2 | 1 | 2 | 100.0 | 2.00 | 1.00 / 2.00 |" in table and "needs 16 devices" in table
    pytest.importorskip("matplotlib")
    out = tmp_path / "s.png"
    assert sweep.plot({"configs": rows, "device": "cpu", "num_devices": 8, "date": "today"}, str(out))
    assert out.stat().st_size > 1000

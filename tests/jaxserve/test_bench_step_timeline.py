"""`jaxserve.bench.step_timeline` (per-step wall, host and wait time of the engine loop) and
`jaxserve.bench.matmul_shapes` (the model's matmul shapes timed alone), on the CPU."""

from __future__ import annotations

import json

import pytest
from engine_fixtures import run_cache_dir
from tiny_models import make_tiny_checkpoint

from jaxserve.bench import matmul_shapes, step_timeline
from jaxserve.bench.model_shapes import SHAPES
from jaxserve.cli import main


class _FakeEngine:
    """An engine whose steps take turns waiting 0 and 2 ms of a 3 ms step."""

    def __init__(self):
        self.loop_time = {"wait_s": 0.0}
        self.scheduler = type("S", (), {"running": [1, 2, 3]})()
        self._in_flight = None
        self.calls = 0

    def step(self):
        self.calls += 1
        self.loop_time["wait_s"] += 0.002 if self.calls % 2 else 0.0
        return ["out"]


def test_record_wraps_step_and_restores_it():
    engine = _FakeEngine()
    original = engine.step
    with step_timeline.record(engine) as steps:
        assert engine.step() == ["out"] and engine.step() == ["out"]
    assert engine.step == original  # unwrapped after the block
    assert [s["wait_s"] for s in steps] == [pytest.approx(0.002), 0.0]
    assert all(s["running"] == 3 and s["tokens"] == 0 and s["wall_s"] >= 0 for s in steps)


def test_summary_groups_consecutive_steps():
    steps = [dict(wall_s=0.003, wait_s=0.002 * (i % 2), tokens=10 * i, running=4) for i in range(5)]
    rows = step_timeline.summarize(steps, group=2)
    assert [(r["first"], r["steps"]) for r in rows] == [(0, 2), (2, 2), (4, 1)]
    assert rows[0]["wall_ms"] == pytest.approx(3.0) and rows[0]["wait_ms"] == pytest.approx(1.0)
    assert rows[0]["host_ms"] == pytest.approx(2.0) and rows[2]["tokens"] == pytest.approx(40)
    text = step_timeline.format_summary(rows)
    assert "wall ms" in text and "0.015 s in the loop, 0.004 s of it waiting" in text  # 5 x 3 ms, 2 x 2 ms


def test_a_router_without_a_loop_records_nothing():
    router = type("R", (), {"step": lambda self: []})()
    with step_timeline.record(router) as steps:
        router.step()
    assert steps == []


def test_throughput_bench_writes_the_timeline(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", max_position_embeddings=256)
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", str(model), "--num-prompts", "6", "--input-len", "12", "--output-len",
               "5", "--max-model-len", "128", "--compilation-cache-dir", run_cache_dir(), "--output-json", str(out)])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["step_timeline"]
    assert rows and sum(r["steps"] for r in rows) >= 5  # at least one step per output token
    assert all(r["wall_ms"] >= r["wait_ms"] >= 0 for r in rows)
    per_step = result["step_times"]  # every step, [wall ms, wait ms, tokens, running]
    assert len(per_step) == sum(r["steps"] for r in rows)
    assert all(wall >= wait >= 0 and tokens >= 0 and running >= 0 for wall, wait, tokens, running in per_step)


def test_matmul_shapes_projections_and_a_quick_run(tmp_path, capsys):
    projs = matmul_shapes.projections(SHAPES["llama3-8b"])
    assert projs["qkv"] == (4096, 6144) and projs["gate_up"] == (4096, 28672) and projs["down"] == (14336, 4096)
    assert projs["lm_head"] == (4096, 128256)
    out = tmp_path / "mm.json"
    assert matmul_shapes.main(["--shape", "llama3.2-1b", "--rows", "2", "--only", "o", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["proj"] == "o" and row["m"] == 2 and row["xla_s"] > 0 and "torch_s" not in row
    assert "XLA_FLAGS=" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        matmul_shapes.main(["--only", "nope"])

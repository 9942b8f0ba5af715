"""Per-step timing of the engine loop: which stretches of a run the host sets the pace of, and which the device.

``record(engine)`` wraps ``engine.step`` for the length of a ``with`` block and keeps, per call, its wall time,
the part spent blocked reading a step's tokens back (``loop_time["wait_s"]``), the tokens it scheduled and the
requests running. In the asynchronous loop a call dispatches step N+1, then reads step N back: a call that
waits is paced by the device, one that does not is paced by its own host work. ``summarize`` folds the calls
into groups of consecutive steps, so a 300-step run reads as a dozen lines.
"""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def record(engine):
    """Record every ``engine.step`` call made inside the block; yields the list of per-step dicts."""
    steps: list[dict] = []
    if not hasattr(engine, "loop_time"):  # a data-parallel router: its replicas run the loops
        yield steps
        return
    inner = engine.step

    def step():
        wait0 = engine.loop_time["wait_s"]
        t0 = time.perf_counter()
        out = inner()
        dur = time.perf_counter() - t0
        in_flight = getattr(engine, "_in_flight", None)
        tokens = in_flight[0].num_batched_tokens if in_flight else 0
        steps.append(dict(wall_s=dur, wait_s=engine.loop_time["wait_s"] - wait0, tokens=tokens,
                          running=len(engine.scheduler.running)))  # fmt: skip
        return out

    engine.step = step
    try:
        yield steps
    finally:
        engine.step = inner


def summarize(steps: list[dict], group: int = 25) -> list[dict]:
    """Groups of ``group`` consecutive steps: first step, count, mean wall / host / wait ms, mean tokens, running."""
    rows = []
    for i in range(0, len(steps), group):
        chunk = steps[i : i + group]
        n = len(chunk)
        wall = sum(s["wall_s"] for s in chunk) / n
        wait = sum(s["wait_s"] for s in chunk) / n
        rows.append(dict(first=i, steps=n, wall_ms=1e3 * wall, host_ms=1e3 * (wall - wait), wait_ms=1e3 * wait,
                         tokens=sum(s["tokens"] for s in chunk) / n, running=sum(s["running"] for s in chunk) / n))  # fmt: skip
    return rows


def per_step(steps: list[dict]) -> list[list]:
    """Every step as [wall ms, wait ms, tokens, running], rounded: compact enough to keep in a result file,
    for the stretches a group's mean hides (a tail of a dozen steps)."""
    return [[round(1e3 * s["wall_s"], 3), round(1e3 * s["wait_s"], 3), s["tokens"], s["running"]] for s in steps]


def format_summary(rows: list[dict]) -> str:
    lines = ["steps      wall ms  host ms  wait ms  tokens  running"]
    for r in rows:
        lines.append(f"{r['first']:4d}+{r['steps']:<4d} {r['wall_ms']:8.2f} {r['host_ms']:8.2f} {r['wait_ms']:8.2f} "
                     f"{r['tokens']:7.0f} {r['running']:8.1f}")  # fmt: skip
    total = sum(r["wall_ms"] * r["steps"] for r in rows)
    waited = sum(r["wait_ms"] * r["steps"] for r in rows)
    lines.append(f"all: {total / 1e3:.3f} s in the loop, {waited / 1e3:.3f} s of it waiting for the device")
    return "\n".join(lines)

"""A profiler trace of part of a bench, and where its time went, in text (no TensorBoard or Nsight needed).

    python -m jaxserve.bench.trace DIR [--top 15]

``capture(dir)`` wraps ``jax.profiler.trace`` and also writes a Perfetto trace (``*.trace.json.gz``), which
``summarize`` reads back: per device (each ``/device:...`` process of the trace, e.g. a GPU's streams) the
kernels' total time, count and share, the busy time (the union of the kernels' intervals) against the span from
the first kernel's start to the last one's end (the gap is time the device waited for the host), and on the
host the PJRT launch phases that can hold a launch back (``Wait for usage holds``: an input still in use by a
running program; ``Wait for donation holds``: a donated input still read) with the host's largest events.
The benches take ``--trace-dir``: ``bench latency`` traces one extra request, ``bench spec-sweep`` one per row,
``bench throughput`` a window of steps (``--trace-steps``) of the workload run once more.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import glob
import gzip
import json
import os

# Host events that say a launch waited (PJRT's execute path); reported whenever present.
LAUNCH_WAITS = ("Wait for usage holds", "Wait for donation holds", "Wait for input events", "Handle inputs")


@contextlib.contextmanager
def capture(out_dir: str):
    """Trace what runs inside the block into ``out_dir`` (created), with a Perfetto trace for ``summarize``."""
    import jax

    os.makedirs(out_dir, exist_ok=True)
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        yield


class WindowMissed(ValueError):
    """The traced run ended before the window's first step: nothing was traced (the run itself went well)."""


@contextlib.contextmanager
def step_window(engine, out_dir: str, first: int, count: int):
    """Trace engine steps ``first`` .. ``first + count - 1`` of what runs inside the block (a window of a long
    run, whose whole trace would be large), into ``out_dir``."""
    import jax

    os.makedirs(out_dir, exist_ok=True)
    step, seen, active = engine.step, [0], [False]

    def traced_step():
        if seen[0] == first:
            jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
            active[0] = True
        try:
            return step()
        finally:
            seen[0] += 1
            if active[0] and seen[0] == first + count:
                jax.profiler.stop_trace()
                active[0] = False

    engine.step = traced_step
    try:
        yield
    finally:
        del engine.step  # the class's method again
        if active[0]:  # the run ended inside the window
            jax.profiler.stop_trace()
    if not seen[0] > first:  # (only when the block ran to its end: an error inside it is the one to see)
        raise WindowMissed(f"the run took {seen[0]} steps, so a trace from step {first} never started: "
                           f"lower the first step of --trace-steps")


def parse_window(text: str) -> tuple[int, int]:
    """--trace-steps FIRST:COUNT -> (first, count)."""
    try:
        first, count = (int(x) for x in text.split(":"))
    except ValueError:
        first = count = -1
    if first < 0 or count < 1:
        raise ValueError(f"--trace-steps={text!r} is invalid: give FIRST:COUNT, e.g. 100:20 (steps 100..119)")
    return first, count


def find_trace(out_dir: str) -> str:
    """The newest ``*.trace.json.gz`` under ``out_dir``."""
    paths = glob.glob(os.path.join(out_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {out_dir!r}: was it written by capture() (a Perfetto trace)?")
    return max(paths, key=os.path.getmtime)


@dataclasses.dataclass
class Summary:
    devices: dict  # device name -> {"span_ms", "busy_ms", "kernels": [(name, total_ms, count)]}
    launch_waits: list  # [(name, total_ms, count)] of LAUNCH_WAITS present
    host_top: list  # [(name, total_ms, count)]: the host's largest events, by total time

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(path_or_dir: str, top: int = 15) -> Summary:
    """Read a Perfetto trace (a file, or the newest one under a directory) into a Summary."""
    path = find_trace(path_or_dir) if os.path.isdir(path_or_dir) else path_or_dir
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    per_device: dict = collections.defaultdict(list)  # name -> [(start us, dur us, kernel)]
    host = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        proc = procs.get(e.get("pid"), "")
        if proc.startswith("/device:"):
            per_device[proc].append((float(e["ts"]), float(e["dur"]), e.get("name", "")))
        elif not e.get("name", "").startswith("$"):  # "$file:line fn": Python frames of the profiler itself
            h = host[e.get("name", "")]
            h[0] += float(e["dur"])
            h[1] += 1
    devices = {}
    for name, spans in sorted(per_device.items()):
        kernels = collections.defaultdict(lambda: [0.0, 0])
        for _, dur, kernel in spans:
            kernels[kernel][0] += dur
            kernels[kernel][1] += 1
        devices[name] = {
            "span_ms": (max(s + d for s, d, _ in spans) - min(s for s, _, _ in spans)) / 1e3,
            "busy_ms": _union(spans) / 1e3,
            "kernels": [(k, t / 1e3, n) for k, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        }
    waits = [(w, host[w][0] / 1e3, host[w][1]) for w in LAUNCH_WAITS if w in host]
    host_top = [(k, t / 1e3, n) for k, (t, n) in sorted(host.items(), key=lambda kv: -kv[1][0])[:top]]
    return Summary(devices, waits, host_top)


def _union(spans) -> float:
    """Total length covered by the intervals (start, duration, _), in their unit."""
    total, end = 0.0, float("-inf")
    for start, dur, _ in sorted(spans):
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def format_summary(s: Summary, top: int = 10) -> str:
    lines = []
    for name, d in s.devices.items():
        busy = d["busy_ms"] / d["span_ms"] if d["span_ms"] else 0.0
        lines.append(f"{name}: busy {d['busy_ms']:.2f} of {d['span_ms']:.2f} ms ({100 * busy:.0f}%); kernels by time:")
        for kernel, ms, n in d["kernels"][:top]:
            lines.append(f"  {ms:9.3f} ms  {n:6d}x  {kernel[:100]}")
    if not s.devices:
        lines.append("no device events in the trace (on CPU, XLA's work shows as host events)")
    for name, ms, n in s.launch_waits:
        lines.append(f"host, launch phase '{name}': {ms:.3f} ms over {n} events")
    lines.append("host, largest events:")
    for name, ms, n in s.host_top[:top]:
        lines.append(f"  {ms:9.3f} ms  {n:6d}x  {name[:100]}")
    return "\n".join(lines)


def report(out_dir: str, heading: str) -> dict:
    """Summarize the trace under ``out_dir``, print it under ``heading``; the summary as a dict (a bench's JSON)."""
    summary = summarize(out_dir)
    print(f"{heading}\n{format_summary(summary)}", flush=True)
    return summary.to_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.trace", description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a *.trace.json.gz, or a directory holding one (the newest is read)")
    p.add_argument("--top", type=int, default=15, help="kernels and host events listed")
    p.add_argument("--json", dest="json_out", default=None, help="also write the summary as JSON here")
    ns = p.parse_args(argv)
    s = summarize(ns.trace, ns.top)
    print(format_summary(s, ns.top))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump(s.to_dict(), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

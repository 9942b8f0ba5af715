"""Session 37: what reading a streamed reply's tool calls costs per delta, before and after the readers that
remember what they read (BENCHMARKS §48). Run from the repository root with the two versions' files beside it:

    git show c4d8ea8:server/tool_parsers.py > /tmp/old_tool_parsers.py
    git show c4d8ea8:server/tool_calls.py > /tmp/old_tool_calls.py
    python docs/results/tool_stream_s37/bench_tool_stream.py /tmp

Each reply is fed 4 characters a delta (about a token), then once more as final; the figure is µs a delta, the
best of 5 runs, old and new alternating.
"""

import importlib.util
import json
import sys
import time
import types


def load_old(folder: str):
    """The old tool_parsers/tool_calls as modules of their own (tool_calls imports tool_parsers by its package name)."""
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod

    parsers = load("old_tool_parsers", f"{folder}/old_tool_parsers.py")
    saved = sys.modules.get("jaxserve.server.tool_parsers")
    sys.modules["jaxserve.server.tool_parsers"] = parsers
    try:
        calls = load("old_tool_calls", f"{folder}/old_tool_calls.py")
    finally:
        sys.modules["jaxserve.server.tool_parsers"] = saved
    return types.SimpleNamespace(parsers=parsers, calls=calls)


def per_delta_us(stream_cls, plan, text: str, step: int = 4) -> float:
    best = float("inf")
    for _ in range(5):
        s = stream_cls(plan)
        t = time.perf_counter()
        for i in range(0, len(text), step):
            s.feed(text[i : i + step], final=False)
        s.feed("", final=True)
        best = min(best, (time.perf_counter() - t) / (len(text) // step + 2) * 1e6)
    return best


def workloads():
    for n in (4, 16, 64):
        calls = [{"name": "get_weather", "parameters": {"city": f"City {i}", "days": i, "notes": "x" * 40}}
                 for i in range(n)]
        yield f"{n} calls", {
            "required": json.dumps(calls),
            "hermes": "".join(f"<tool_call>{json.dumps({'name': c['name'], 'arguments': c['parameters']})}</tool_call>\n"
                              for c in calls),
            "llama3_json": "; ".join(json.dumps(c) for c in calls),
        }
    for chars in (4000, 64000):
        text = "word " * (chars // 5)
        yield f"content, {chars} chars", {"hermes": text, "llama3_json": text}


def main(folder: str) -> None:
    from jaxserve.server import tool_calls as new_calls
    from jaxserve.server import tool_parsers as new_parsers

    old = load_old(folder)
    rows = []
    for label, texts in workloads():
        for fmt, text in texts.items():
            row = {"workload": label, "format": fmt, "chars": len(text)}
            for tag, calls_mod, parsers_mod in (("old", old.calls, old.parsers), ("new", new_calls, new_parsers)):
                parser = {"required": parsers_mod.parse_call_array, "hermes": parsers_mod.parse_hermes,
                          "llama3_json": parsers_mod.parse_llama3_json}[fmt]
                row[tag] = round(per_delta_us(calls_mod.ToolCallStream, calls_mod.ToolPlan(parser, True), text), 1)
            rows.append(row)
            print(row, flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1])

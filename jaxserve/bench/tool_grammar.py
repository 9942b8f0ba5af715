"""What a forced tool call costs before its first step: the grammar's compile time and its first mask.

    python -m jaxserve.bench.tool_grammar [--tokenizer PATH] [--tools 1,8,32] [--out FILE]

A request with tool_choice "required" (or a named function) generates under a JSON schema built from its tools
(server/tool_calls.py), compiled when the request is added. For each count of tools (each with three parameters)
this compiles the "required" schema and a named choice's, and times the compile and the first mask (median of 7).
The tokenizer is the default model's unless --tokenizer names a directory or .gguf file. Prints a table and
writes JSON with --out.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _tool(i: int):
    from jaxserve.server.protocol import Tool

    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"}},
        "required": ["city"],
    }
    return Tool.model_validate({"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters}})


def _time(compiler, schema, repeats: int = 7) -> tuple[float, float]:
    """Median compile and first-mask seconds of ``schema``."""
    import numpy as np

    from jaxserve.structured_output import StructuredOutputsParams

    compile_s, mask_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        grammar = compiler.compile(StructuredOutputsParams(json=schema))
        compile_s.append(time.perf_counter() - start)
        mask = np.full((1, grammar.words), -1, np.int32)
        start = time.perf_counter()
        grammar.fill(mask, 0)
        mask_s.append(time.perf_counter() - start)
    return statistics.median(compile_s), statistics.median(mask_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.tool_grammar", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory or .gguf file (default: the default model's)")
    p.add_argument("--tools", default="1,8,32", help="comma-separated counts of tools (default 1,8,32)")
    p.add_argument("--out", default=None, help="write the JSON here")
    ns = p.parse_args(argv)
    counts = [int(n) for n in ns.tools.split(",")]

    import platform

    import llguidance

    from jaxserve.bench import report
    from jaxserve.model_loader import load_tokenizer, resolve_model_path
    from jaxserve.server.protocol import NamedToolChoice
    from jaxserve.server.tool_calls import forced_call_schema
    from jaxserve.structured_output import StructuredOutputsParams, GrammarCompiler

    tokenizer = load_tokenizer(ns.tokenizer or resolve_model_path(None, "auto")[0])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    compiler.compile(StructuredOutputsParams(json={"type": "object"}))  # llguidance's tokenizer view: once per engine
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "tool_0"}})
    rows = []
    for n in counts:
        tools = [_tool(i) for i in range(n)]
        for choice, label in (("required", "required"), (named, "named")):
            compile_s, mask_s = _time(compiler, forced_call_schema(tools, choice, True))
            rows.append({"tool_choice": label, "tools": n, "compile_ms": round(1e3 * compile_s, 2),
                         "first_mask_ms": round(1e3 * mask_s, 3)})
    print(f"{'tool_choice':>11} {'tools':>5} {'compile ms':>10} {'first mask ms':>13}")
    for r in rows:
        print(f"{r['tool_choice']:>11} {r['tools']:>5} {r['compile_ms']:>10.2f} {r['first_mask_ms']:>13.3f}")
    result = {"rows": rows, "vocabulary": len(tokenizer), "llguidance": llguidance.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    report.write_json(result, ns.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

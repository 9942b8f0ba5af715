"""How far two agreement records of one model agree, position by position.

Teacher-forced positions are those where both runs saw the same tokens: every prompt position, and each greedy
continuation up to and including its first divergence (the contexts are equal until a token differs). On them:
the difference of the scored token's logprob (|d|), and whether the two runs rank the same token first.

A greedy divergence is where the runs chose different tokens a (the reference's) and b (the other's) after equal
contexts. The reference's margin is lp_ref(a) - lp_ref(b) >= 0 and the other's lp_other(b) - lp_other(a) >= 0.
Their sum equals the change between runs of lp(a) - lp(b), which rounding keeps within 2 * max |d|: a divergence
whose margins sum to no more than that (``tolerance``) is a near tie flipped by rounding; one above it is a
difference rounding does not explain (a bug, or settings that change the model) and is flagged."""

from __future__ import annotations

from typing import Any


def _lp(pos: dict, token: int) -> float | None:
    """``token``'s logprob at a position: the scored token's, or one of the top k; None when not listed."""
    if pos["token"] == token:
        return pos["logprob"]
    for t, lp in pos["top"]:
        if t == token:
            return lp
    return None


def _margin(pos: dict, mine: int, theirs: int) -> tuple[float, bool]:
    """lp(mine) - lp(theirs) at ``pos``, and whether it is exact (False: ``theirs`` is not in the top k, and the
    value is a lower bound taken from the last listed token)."""
    own, other = _lp(pos, mine), _lp(pos, theirs)
    if other is not None:
        return own - other, True
    return own - pos["top"][-1][1], False


def check_comparable(ref: dict, other: dict, ref_name: str, other_name: str) -> None:
    if len(ref["prompts"]) != len(other["prompts"]):
        raise ValueError(f"{ref_name} has {len(ref['prompts'])} prompts and {other_name} {len(other['prompts'])}: "
                         "records from different jaxserve versions cannot be compared; record both again")  # fmt: skip
    for i, (a, b) in enumerate(zip(ref["prompts"], other["prompts"])):
        if a["prompt_token_ids"] != b["prompt_token_ids"]:
            raise ValueError(f"prompt {i} has different tokens in {ref_name} and {other_name}: the records are of "
                             "models with different tokenizers; compare records of one model")  # fmt: skip


def compare(ref: dict, other: dict, ref_name: str = "reference", other_name: str = "other") -> dict[str, Any]:
    """The agreement of ``other`` with ``ref`` (two records' dicts), as a JSON-ready dict."""
    check_comparable(ref, other, ref_name, other_name)
    diffs: list[float] = []
    top1_same = top1_total = 0
    prompt_positions = generated_positions = 0
    identical = tokens_matched = tokens_total = 0
    divergences = []

    def forced(pa: dict, pb: dict) -> None:
        nonlocal top1_same, top1_total
        top1_total += 1
        top1_same += bool(pa["top"]) and bool(pb["top"]) and pa["top"][0][0] == pb["top"][0][0]

    for i, (a, b) in enumerate(zip(ref["prompts"], other["prompts"])):
        for pa, pb in zip(a["prompt_positions"], b["prompt_positions"]):
            diffs.append(abs(pa["logprob"] - pb["logprob"]))
            forced(pa, pb)
            prompt_positions += 1
        ga, gb = a["greedy_positions"], b["greedy_positions"]
        n = min(len(ga), len(gb))
        tokens_total += n
        first = next((j for j in range(n) if ga[j]["token"] != gb[j]["token"]), None)
        for j in range(n if first is None else first + 1):
            forced(ga[j], gb[j])
            generated_positions += 1
            if j != first:
                diffs.append(abs(ga[j]["logprob"] - gb[j]["logprob"]))
        if first is None:
            identical += 1
            tokens_matched += n
            continue
        tokens_matched += first
        ta, tb = ga[first]["token"], gb[first]["token"]
        ref_margin, ref_exact = _margin(ga[first], ta, tb)
        other_margin, other_exact = _margin(gb[first], tb, ta)
        divergences.append({"prompt": i, "position": first, "ref_token": ta, "other_token": tb,
                            "ref_margin": ref_margin, "ref_margin_exact": ref_exact,
                            "other_margin": other_margin, "other_margin_exact": other_exact})  # fmt: skip
    max_diff = max(diffs, default=0.0)
    tolerance = 2 * max_diff
    for d in divergences:
        d["explained"] = d["ref_margin_exact"] and d["other_margin_exact"] and d["ref_margin"] + d["other_margin"] <= tolerance
    ordered = sorted(diffs)
    return {
        "reference": ref_name,
        "other": other_name,
        "positions": {"prompt": prompt_positions, "generated": generated_positions},
        "logprob_diff": {
            "max": max_diff,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0,
            "mean": sum(diffs) / len(diffs) if diffs else 0.0,
        },
        "top1_agreement": top1_same / top1_total if top1_total else 1.0,
        "greedy": {"prompts": len(ref["prompts"]), "identical": identical, "tokens_matched": tokens_matched,
                   "tokens": tokens_total},  # fmt: skip
        "tolerance": tolerance,
        "divergences": divergences,
        "unexplained": sum(not d["explained"] for d in divergences),
    }


def _describe(rec: dict) -> dict[str, str]:
    info = rec.get("engine_info", {})
    return {
        "backend": str(rec.get("backend", "?")),
        "device": str(rec.get("device", "?")),
        "dtype": str(info.get("dtype", "?")),
        "matmul": str(info.get("fp32_matmul_precision", "")) if info.get("dtype") == "float32" else "",
        "attention": str(info.get("attention_backend", "?")),
        "tp": str(info.get("tensor_parallel_size", 1)),
        "dp": str(info.get("data_parallel_size", 1)),
        "quantization": str((rec.get("engine_args") or {}).get("quantization") or "none"),
        "versions": str(rec.get("versions") or f"jax {rec.get('jax', '?')}"),
        "date": str(rec.get("date", "?")),
    }


def _token(rec: dict, token: int) -> str:
    text = repr(rec["token_text"].get(str(token), "")).replace("|", "\\|")  # a table cell
    return f"{token} {text}"


def _g(x: float) -> str:
    return f"{x:.3g}"


def markdown(records: dict[str, dict], results: list[dict]) -> str:
    """The report: one row per record, then each record against the first."""
    names = list(records)
    model = records[names[0]].get("engine_info", {}).get("model", "?")
    first = records[names[0]]["prompts"]
    lines = [f"# Agreement report: {model}", "",
             f"{len(first)} prompts, {len(first[0]['greedy_positions']) if first else 0} greedy tokens each (EOS "
             "ignored), logprobs of every prompt and generated position.", ""]  # fmt: skip
    cols = ["backend", "device", "dtype", "matmul", "attention", "tp", "dp", "quantization", "versions", "date"]
    lines += ["| record | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in names:
        d = _describe(records[name])
        lines.append(f"| {name} | " + " | ".join(d[c] for c in cols) + " |")
    for r in results:
        ref, oth = records[r["reference"]], records[r["other"]]
        g, ld = r["greedy"], r["logprob_diff"]
        lines += ["", f"## {r['other']} against {r['reference']}", "",
                  f"- teacher-forced positions: {r['positions']['prompt'] + r['positions']['generated']} "
                  f"({r['positions']['prompt']} prompt, {r['positions']['generated']} generated before a divergence)",
                  f"- |logprob difference| of the scored token: max {_g(ld['max'])}, p99 {_g(ld['p99'])}, "
                  f"mean {_g(ld['mean'])}",
                  f"- the same token ranked first: {100 * r['top1_agreement']:.2f}% of those positions",
                  f"- greedy: {g['identical']} of {g['prompts']} continuations identical; {g['tokens_matched']} of "
                  f"{g['tokens']} tokens ({100 * g['tokens_matched'] / max(g['tokens'], 1):.1f}%) before the first "
                  "divergence"]  # fmt: skip
        if r["divergences"]:
            lines += [f"- divergences explained by rounding (margins summing to at most 2 x max |difference| = "
                      f"{_g(r['tolerance'])}): {len(r['divergences']) - r['unexplained']} of {len(r['divergences'])}",
                      "", f"| prompt | position | {r['reference']} chose | {r['other']} chose | its margin | "
                      "other's margin | rounding? |", "|---|---:|---|---|---:|---:|---|"]  # fmt: skip
            for d in r["divergences"]:
                rm = ("" if d["ref_margin_exact"] else ">") + _g(d["ref_margin"])
                om = ("" if d["other_margin_exact"] else ">") + _g(d["other_margin"])
                lines.append(f"| {d['prompt']} | {d['position']} | {_token(ref, d['ref_token'])} | "
                             f"{_token(oth, d['other_token'])} | {rm} | {om} | "
                             f"{'yes' if d['explained'] else '**no**'} |")  # fmt: skip
    return "\n".join(lines) + "\n"

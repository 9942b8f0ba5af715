"""`jaxserve agreement record OUT.json [engine options]` and `jaxserve agreement compare REF.json OTHER.json ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxserve.agreement.prompts import PROMPTS


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("agreement", help="how far runs of one model agree across platforms, dtypes and kernels: "
                       "record a run, then compare records",
                       description="Record what a run computes on a fixed prompt set (greedy, with logprobs), on "
                       "each platform or setting, then compare the records: logprob differences on equal contexts, "
                       "top-1 agreement, and each greedy divergence with whether rounding explains it.")  # fmt: skip
    agree_sub = p.add_subparsers(dest="agreement_command", required=True)

    rec = agree_sub.add_parser("record", help="run the fixed prompts greedily and write a record (JSON)")
    rec.add_argument("output", metavar="OUT.json", help="where the record goes")
    rec.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64,
                     help="greedy tokens generated per prompt, EOS ignored (default: 64)")
    rec.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=len(PROMPTS),
                     help=f"the first N of the {len(PROMPTS)} fixed prompts (default: all)")
    rec.add_argument("--k", type=int, default=5, help="top alternatives kept per position (default: 5)")
    rec.add_argument("--hf", action="store_true",
                     help="record with HF transformers instead (needs torch; the same prompt ids, the model and "
                     "--dtype of the engine options; the GPU when torch sees one)")
    add_engine_args(rec)
    rec.set_defaults(func=_record)

    cmp = agree_sub.add_parser("compare", help="compare records with the first one; print a Markdown report")
    cmp.add_argument("records", nargs="+", metavar="RECORD.json", help="two or more records; the first is the reference")
    cmp.add_argument("--output", default=None, help="also write the Markdown report here")
    cmp.add_argument("--output-json", "--output_json", dest="output_json", default=None,
                     help="write the comparison's numbers as JSON here")
    cmp.set_defaults(func=_compare)


def _record(ns: argparse.Namespace) -> int:
    from jaxserve.agreement import record
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import MAX_LOGPROBS

    if ns.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {ns.max_tokens}")
    if not 1 <= ns.num_prompts <= len(PROMPTS):
        raise ValueError(f"--num-prompts must be in [1, {len(PROMPTS)}], got {ns.num_prompts}")
    if not 1 <= ns.k <= MAX_LOGPROBS:
        raise ValueError(f"--k must be in [1, {MAX_LOGPROBS}], got {ns.k}")
    args = engine_args_from(ns)
    if args.skip_tokenizer_init:  # said before the model loads, not after
        raise ValueError(record.NEEDS_TOKENIZER)
    result = {"format": record.FORMAT, "k": ns.k, "max_tokens": ns.max_tokens}
    texts = PROMPTS[: ns.num_prompts]
    if ns.hf:
        result.update(record.hf_record(args, k=ns.k, max_tokens=ns.max_tokens, prompts=texts))
    else:
        llm = LLM(**dataclasses.asdict(args))
        result.update(record.platform_fields(llm, args))
        result.update(record.record(llm, k=ns.k, max_tokens=ns.max_tokens, prompts=texts))
    with open(ns.output, "w") as f:
        json.dump(result, f)
    n = sum(len(p["prompt_positions"]) + len(p["greedy_positions"]) for p in result["prompts"])
    print(f"jaxserve: recorded {len(result['prompts'])} prompts ({n} positions) on {result['device']} "
          f"({result['engine_info']['dtype']}) to {ns.output}", file=sys.stderr)  # fmt: skip
    return 0


def load_record(path: str) -> dict:
    from jaxserve.agreement import record

    with open(path) as f:
        try:
            rec = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not JSON ({e}): pass files written by `jaxserve agreement record`") from None
    if not isinstance(rec, dict) or rec.get("format") != record.FORMAT:
        raise ValueError(f"{path!r} is not an agreement record (format {record.FORMAT!r}): write one with "
                         "`jaxserve agreement record OUT.json`")  # fmt: skip
    return rec


def _compare(ns: argparse.Namespace) -> int:
    from jaxserve.agreement import compare

    if len(ns.records) < 2:
        raise ValueError("compare needs at least two records: the reference first, then the others")
    records: dict[str, dict] = {}
    for path in ns.records:  # a record is named by its file's name in the report
        name = os.path.splitext(os.path.basename(path))[0]
        name = name if name not in records else f"{name} ({len(records) + 1})"
        records[name] = load_record(path)
    names = list(records)
    results = [compare.compare(records[names[0]], records[n], names[0], n) for n in names[1:]]
    text = compare.markdown(records, results)
    print(text, end="")
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(text)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0

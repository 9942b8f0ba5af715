"""`jaxserve bench structured`: what a JSON schema costs the engine (structured outputs vs none, same tokens).

--num-prompts random prompts of about --input-len tokens each generate a JSON record under a schema (strings of
bounded length, an integer, an enum, a short array), greedy. Then the same prompts run unconstrained, each
generating exactly as many tokens as its constrained run did (ignore_eos), so the two runs do the same model work
and differ only by the grammar: its host work each step (taking the token just read back, then the next masks),
the masks' trip to the device, and the sampler's wait for them (the model itself still overlaps that host work:
architecture.md, "Wait, but only the sampler"). Reported: output tokens/s of both, the cost in %, and the share
of outputs that parse and fit the schema.

    jaxserve bench structured [--model DIR] [--num-prompts 64 --input-len 256]
        [--constraint json | bad_words | allowed_token_ids]

``--constraint`` other than json prices the token rules that share the grammar's mask instead: ``bad_words`` bans
BAD_WORDS (common English words, each banned after its other tokens), ``allowed_token_ids`` allows the lower half
of the vocabulary; each request generates --max-tokens tokens (ignore_eos), then the same tokens run unconstrained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

# A record a model can fill in any order of words: every string is bounded, so every output ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "email", "tags"],
    "additionalProperties": False,
}


# --constraint bad_words: words a model writes all the time, so their bans apply at many steps.
BAD_WORDS = ["the", "and", "of", "to", "in", "is", "that", "it"]
CONSTRAINTS = ("json", "bad_words", "allowed_token_ids")


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("structured", help="structured outputs (a JSON schema) vs the same tokens unconstrained")
    p.add_argument("--num-prompts", "--num_prompts", dest="num_prompts", type=int, default=64)
    p.add_argument("--input-len", "--input_len", dest="input_len", type=int, default=256)
    p.add_argument("--range-ratio", "--range_ratio", dest="range_ratio", type=float, default=0.5,
                   help="prompt lengths uniform in input-len * (1 -/+ ratio)")
    p.add_argument("--constraint", choices=CONSTRAINTS, default="json",
                   help="json: a JSON schema (default); bad_words / allowed_token_ids: the token rules instead")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=64,
                   help="tokens per request under bad_words / allowed_token_ids (default 64)")
    p.add_argument("--output-json", "--output_json", dest="output_json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def fits(text: str) -> bool:
    """Whether ``text`` parses as JSON and fits SCHEMA."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (
        isinstance(value, dict) and set(value) == set(props)
        and isinstance(value["name"], str) and len(value["name"]) <= 24
        and isinstance(value["age"], int) and 0 <= value["age"] <= 120
        and value["role"] in props["role"]["enum"]
        and isinstance(value["email"], str) and len(value["email"]) <= 32
        and isinstance(value["tags"], list) and len(value["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 10 for t in value["tags"])
    )  # fmt: skip


def run(ns: argparse.Namespace) -> int:

    from jaxserve.bench import latency, report
    from jaxserve.bench.workload import random_workload
    from jaxserve.cli import engine_args_from
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    args = engine_args_from(ns)
    _, cfg = latency.model_path_and_config(args)
    work = random_workload(ns.num_prompts, ns.input_len, 1, ns.range_ratio, cfg.vocab_size, seed=0,
                           token_range=(100, min(cfg.vocab_size, 32000)))
    batch = [{"prompt_token_ids": w.prompt_token_ids} for w in work]
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(args))
    startup_s = time.perf_counter() - t0
    engine = llm.llm_engine
    room = engine.model_config.max_model_len - max(len(w.prompt_token_ids) for w in work)
    rules = {"json": dict(max_tokens=min(256, room), structured_outputs={"json": SCHEMA}),
             "bad_words": dict(max_tokens=min(ns.max_tokens, room), ignore_eos=True, bad_words=BAD_WORDS),
             "allowed_token_ids": dict(max_tokens=min(ns.max_tokens, room), ignore_eos=True,
                                       allowed_token_ids=list(range(cfg.vocab_size // 2)))}[ns.constraint]
    constrained = SamplingParams(temperature=0.0, **rules)
    llm.generate(batch, constrained, use_tqdm=False)  # warm-up: the grammar's tokenizer view and every step shape
    start = time.perf_counter()
    outs = llm.generate(batch, constrained, use_tqdm=True)
    constrained_s = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    same = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(batch, same, use_tqdm=False)  # warm-up of the unconstrained sampler programs
    start = time.perf_counter()
    llm.generate(batch, same, use_tqdm=False)
    plain_s = time.perf_counter() - start
    tokens = sum(lengths)
    json_ok = ns.constraint == "json" and engine.tokenizer is not None
    valid = sum(fits(o.outputs[0].text) for o in outs) if json_ok else None
    result = {
        "engine": "jaxserve",
        "model": engine.model_config.served_model_name,
        "workload": dict(num_prompts=ns.num_prompts, input_len=ns.input_len, range_ratio=ns.range_ratio),
        "constraint": ns.constraint,
        "schema": SCHEMA if ns.constraint == "json" else rules.get("bad_words", "allowed_token_ids: lower half"),
        "output_tokens": tokens,
        "constrained_s": constrained_s,
        "constrained_tokens_per_s": tokens / constrained_s,
        "unconstrained_s": plain_s,
        "unconstrained_tokens_per_s": tokens / plain_s,
        "structured_cost": constrained_s / plain_s - 1.0,
        "finish_reasons": {r: sum(o.outputs[0].finish_reason == r for o in outs) for r in ("stop", "length")},
        "valid_outputs": valid,
        "example": outs[0].outputs[0].text,
        "startup_s": startup_s,
        **report.run_fields(engine, args),
    }
    what = (f"JSON records ({tokens} tokens, {valid} of {len(batch)} parse and fit the schema)" if ns.constraint ==
            "json" else f"outputs under {ns.constraint} ({tokens} tokens)")
    print(f"jaxserve: {len(batch)} {what} in {constrained_s:.2f}s: {result['constrained_tokens_per_s']:.0f} out tok/s; "
          f"the same tokens unconstrained {result['unconstrained_tokens_per_s']:.0f} tok/s (the {ns.constraint} "
          f"constraint costs {100 * result['structured_cost']:+.0f}%)")
    print(f"example: {result['example']}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("schema", "engine_args")}, indent=1))
    report.write_json(result, ns.output_json)
    return 0

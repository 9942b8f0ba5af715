"""One agreement record: what an engine computes on the fixed prompts (agreement.prompts), greedily.

For each prompt it keeps the logprob of every prompt token and its top k (prompt logprobs: the same tokens on
every run, a teacher-forced comparison) and the greedy continuation of ``max_tokens`` tokens with the same
per position (EOS ignored, so every record has the same length). A position is {"token", "logprob", "top":
[[id, logprob], ...] by rank}. Tokens' texts are kept for the report (``token_text``)."""

from __future__ import annotations

from typing import Any

FORMAT = "jaxserve-agreement/1"


NEEDS_TOKENIZER = "an agreement record needs the model's tokenizer (drop --skip-tokenizer-init): its prompts are text"


def position(entry: dict, token: int, k: int) -> dict[str, Any]:
    """One position of a LogprobsDict ({token_id: Logprob}) as plain JSON: the scored token and the top k."""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)
    return {"token": token, "logprob": entry[token].logprob, "top": [[t, lp.logprob] for t, lp in top]}


def record(llm, *, k: int, max_tokens: int, prompts: tuple[str, ...]) -> dict[str, Any]:
    """Run ``prompts`` through ``llm`` (a jaxserve.LLM) and return the record's "prompts" and "token_text"."""
    from jaxserve.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError(NEEDS_TOKENIZER)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    rows = []
    for text, out in zip(prompts, llm.generate(list(prompts), params, use_tqdm=False)):
        done, ids = out.outputs[0], list(out.prompt_token_ids)
        rows.append({"prompt": text, "prompt_token_ids": ids,
                     "prompt_positions": [position(e, t, k) for e, t in zip(out.prompt_logprobs[1:], ids[1:])],
                     "greedy_token_ids": list(done.token_ids),
                     "greedy_positions": [position(e, t, k) for e, t in zip(done.logprobs, done.token_ids)]})  # fmt: skip
    return with_texts(rows, tokenizer)


def hf_record(args, *, k: int, max_tokens: int, prompts: tuple[str, ...]) -> dict[str, Any]:
    """The same record made by HF transformers (agreement.hf_record) from the prompt ids jaxserve's tokenizer
    makes, with the fields platform_fields gives a jaxserve record."""
    import time

    from jaxserve.agreement import hf_record
    from jaxserve.bench.latency import model_path_and_config, resolve_dtype
    from jaxserve.engine_setup import _default_served_name
    from jaxserve.model_loader import load_tokenizer

    path, _ = model_path_and_config(args)
    tokenizer = load_tokenizer(path, args.tokenizer)
    ids = [list(tokenizer.encode(p)) for p in prompts]  # as the engine encodes a text prompt
    dtype = resolve_dtype(args.dtype)
    hf = hf_record.run_in_subprocess(path, ids, dtype, k, max_tokens)
    rows = [{"prompt": text, "prompt_token_ids": p, **row} for text, p, row in zip(prompts, ids, hf["prompts"])]
    name = args.served_model_name or _default_served_name(args.model, path)  # the name jaxserve's record shows
    return {
        "backend": hf["backend"], "device": hf["device"], "date": time.strftime("%Y-%m-%d"),
        "versions": f"torch {hf['torch']}, transformers {hf['transformers']}",
        "engine_info": {"model": name, "dtype": dtype,
                        "fp32_matmul_precision": "highest", "attention_backend": "transformers",
                        "tensor_parallel_size": 1},
        "engine_args": {"model": path, "dtype": dtype},
        **with_texts(rows, tokenizer),
    }  # fmt: skip


def with_texts(rows: list[dict], tokenizer) -> dict[str, Any]:
    """The record's "prompts" with each greedy text, and "token_text": the text of every scored token and of the
    first two ranked at each position (what the report shows at a divergence)."""
    seen = set()
    for row in rows:
        row["greedy_text"] = tokenizer.decode(row["greedy_token_ids"])
        for p in row["prompt_positions"] + row["greedy_positions"]:
            seen.update([p["token"]] + [t for t, _ in p["top"][:2]])
    return {"prompts": rows, "token_text": {str(t): tokenizer.decode([t]) for t in sorted(seen)}}


def platform_fields(llm, args) -> dict[str, Any]:
    """Where and how the record ran: the JAX backend and device, versions, the CPU's name, the engine as built."""
    import platform

    import jax

    from jaxserve.bench import report

    fields = report.run_fields(llm.llm_engine, args)
    fields["backend"] = jax.default_backend()
    fields["versions"] = f"jax {jax.__version__}"
    fields["jaxlib"] = getattr(jax.lib, "__version__", None) or _version("jaxlib")
    fields["host_cpu"] = _cpu_name() or platform.processor()
    return fields


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None

"""The peer of `jaxserve bench score`: HF transformers scoring prompts, as an evaluation harness does.

Run in a subprocess (torch never shares a process or device memory with JAX). The prompts go in length-sorted
static batches, right-padded with an attention mask; one forward pass gives every position's logits, and, as
jaxserve's prompt logprobs do, each prompt token's logprob, its rank and the top k of each position come out of
a log-softmax. The request file: {"model", "batch_size", "dtype", "k", "prompts": [[ids], ...]}. The result has
the timing and, per prompt, the sum of its tokens' logprobs (for the agreement check).
"""

from __future__ import annotations

import json
import sys
import time


def run_in_subprocess(model_path: str, prompts: list[list[int]], batch_size: int, dtype: str, k: int) -> dict:
    from jaxserve.bench.hf_generate import run_in_child

    return run_in_child("jaxserve.bench.hf_score",
                        {"model": model_path, "batch_size": batch_size, "dtype": dtype, "k": k, "prompts": prompts})


def main(req_path: str, res_path: str) -> None:
    import torch
    import transformers

    from jaxserve.bench.hf_generate import load_model, torch_device_and_sync

    with open(req_path) as f:
        spec = json.load(f)
    device, sync = torch_device_and_sync()
    t0 = time.perf_counter()
    model = load_model(spec["model"], spec["dtype"], device)
    model.eval()
    startup_s = time.perf_counter() - t0
    prompts, bs, k = spec["prompts"], spec["batch_size"], spec["k"]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # longest first, as lm-eval sorts
    sums = [0.0] * len(prompts)

    def run_batch(index: list[int]) -> float:
        batch = [prompts[i] for i in index]
        longest = max(len(p) for p in batch)
        ids = torch.tensor([p + [0] * (longest - len(p)) for p in batch], device=device)
        mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in batch], device=device)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            logits = model(ids, attention_mask=mask).logits[:, :-1].float()  # [B, L-1, V]
            logprobs = torch.log_softmax(logits, -1)
            target = ids[:, 1:]
            chosen = logprobs.gather(-1, target[..., None])[..., 0]  # [B, L-1]
            ranks = 1 + (logprobs > chosen[..., None]).sum(-1)  # noqa: F841 (computed as jaxserve does)
            top = torch.topk(logprobs, k, dim=-1) if k else None  # noqa: F841
            per_prompt = (chosen * mask[:, 1:]).sum(-1).tolist()
        sync()
        elapsed = time.perf_counter() - start
        for i, s in zip(index, per_prompt):
            sums[i] = s
        return elapsed

    run_batch(order[:1])  # warm-up
    batch_s = [run_batch(order[i : i + bs]) for i in range(0, len(order), bs)]
    elapsed = sum(batch_s)
    tokens = sum(len(p) for p in prompts)
    with open(res_path, "w") as f:
        json.dump({
            "engine": "hf-transformers-forward",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": spec["dtype"],
            "torch_threads": torch.get_num_threads(),
            "batch_size": bs,
            "startup_s": startup_s,
            "elapsed_s": elapsed,
            "batch_s": batch_s,
            "prompt_tokens": tokens,
            "prompt_tokens_per_s": tokens / elapsed,
            "logprob_sums": sums,
        }, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

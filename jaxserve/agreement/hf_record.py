"""An agreement record from HF transformers (the peer, and on the CPU in float32 the ground truth).

Run in a subprocess (torch never shares a process or device memory with JAX). It takes the prompt token ids that
jaxserve's tokenizer made, so both sides score the same tokens: one forward pass per prompt gives the prompt
positions, then a greedy loop over the KV cache gives ``max_tokens`` tokens, EOS ignored, as
jaxserve.agreement.record does. The request file: {"model", "dtype", "k", "max_tokens", "prompts": [[ids], ...]};
the result: {"prompts": [{"prompt_positions", "greedy_positions", "greedy_token_ids"}], "device", "torch", ...}.
"""

from __future__ import annotations

import inspect
import json
import sys


def run_in_subprocess(model_path: str, prompts: list[list[int]], dtype: str, k: int, max_tokens: int) -> dict:
    from jaxserve.bench.hf_generate import run_in_child

    return run_in_child("jaxserve.agreement.hf_record",
                        {"model": model_path, "dtype": dtype, "k": k, "max_tokens": max_tokens, "prompts": prompts})


def _position(logprobs, token: int, k: int) -> dict:
    """One position from a [V] float32 log-softmax row, in agreement.record's form."""
    import torch

    top = torch.topk(logprobs, k)
    return {"token": token, "logprob": float(logprobs[token]),
            "top": [[int(t), float(v)] for t, v in zip(top.indices.tolist(), top.values.tolist())]}  # fmt: skip


def main(req_path: str, res_path: str) -> None:
    import torch
    import transformers

    from jaxserve.bench.hf_generate import load_model, torch_device_and_sync

    with open(req_path) as f:
        spec = json.load(f)
    device, _ = torch_device_and_sync()
    model = load_model(spec["model"], spec["dtype"], device)
    model.eval()
    k, max_tokens = spec["k"], spec["max_tokens"]
    # transformers 5.2x renamed forward's `past_key_values` (and the output's field) to `cache`; 5.17 has the old name
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows = []
    with torch.inference_mode():
        for ids in spec["prompts"]:
            x = torch.tensor([ids], device=device)
            out = model(x, use_cache=True)
            logprobs = torch.log_softmax(out.logits[0].float(), -1)  # [L, V]: row j predicts token j + 1
            scored = [_position(logprobs[j - 1], ids[j], k) for j in range(1, len(ids))]
            generated, past, last = [], getattr(out, cache_name), logprobs[-1]
            for _ in range(max_tokens):
                token = int(torch.argmax(last))  # the first of equal maxima, as jaxserve's argmax
                generated.append(_position(last, token, k))
                out = model(torch.tensor([[token]], device=device), use_cache=True, **{cache_name: past})
                past, last = getattr(out, cache_name), torch.log_softmax(out.logits[0, -1].float(), -1)
            rows.append({"prompt_positions": scored, "greedy_positions": generated,
                         "greedy_token_ids": [p["token"] for p in generated]})  # fmt: skip
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(res_path, "w") as f:
        json.dump({"prompts": rows, "device": device_name, "backend": f"torch-{device.type}",
                   "torch": torch.__version__, "transformers": transformers.__version__}, f)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

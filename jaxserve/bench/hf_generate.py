"""The peer baseline on CPU: HF transformers `generate` in static batches on the same requests.

Run by `jaxserve bench throughput --compare-hf` in a subprocess. Needs torch (a test/bench dependency,
never a runtime one); a GGUF model goes through transformers' own GGUF loader (torch + accelerate).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(req_path: str, res_path: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with open(req_path) as f:
        spec = json.load(f)
    path = spec["model"]
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    reqs = spec["requests"]
    bs = spec["batch_size"]
    pad = 0

    def run_batch(batch):
        longest_in = max(len(p) for p, _ in batch)
        longest_out = max(o for _, o in batch)
        ids = torch.tensor([[pad] * (longest_in - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (longest_in - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest_out, min_new_tokens=longest_out,
                           do_sample=False, pad_token_id=pad)

    run_batch([(reqs[0][0][:8], 2)])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(reqs), bs):
        run_batch(reqs[i : i + bs])
    elapsed = time.perf_counter() - start
    asked = sum(o for _, o in reqs)
    result = {
        "engine": "hf-transformers-generate",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "batch_size": bs,
        "elapsed_s": elapsed,
        "output_tokens": asked,
        "output_tokens_per_s": asked / elapsed,
    }
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

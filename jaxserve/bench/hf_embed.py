"""The peer baseline for `jaxserve bench embed`: HF transformers' AutoModel plus the checkpoint's pooling,
computed as sentence-transformers computes it (inputs sorted by length, fixed-size batches each padded to
its longest input, pooled over the attention mask, L2-normalised), on the same token ids.

When the directory is a sentence-transformers model with real weights and the library is installed, the
library itself runs too: its module stack (Transformer, Pooling, Normalize) called on the same padded token
ids, batch by batch, which is what `SentenceTransformer.encode` runs after tokenizing.

Run in a subprocess of its own (torch never shares a process or device memory with JAX). A config-only
directory (`jaxserve.bench.model_shapes`) gets random weights, as jaxserve's --load-format dummy does.
Request file: {"model", "batch_size", "dtype", "pooling", "normalize", "prompts": [[ids], ...]}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run_in_subprocess(model_path: str, prompts: list[list[int]], batch_size: int, dtype: str, pooling: str,
                      normalize: bool) -> dict:  # fmt: skip
    from jaxserve.bench.hf_generate import run_in_child

    return run_in_child("jaxserve.bench.hf_embed", {"model": model_path, "batch_size": batch_size, "dtype": dtype,
                        "pooling": pooling, "normalize": normalize, "prompts": prompts})  # fmt: skip


def _load(path: str, dtype, device):
    import torch
    from transformers import AutoConfig, AutoModel

    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModel.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return AutoModel.from_pretrained(path, dtype=dtype).to(device)


def _sentence_transformers(path: str, device):
    """The library's model of ``path`` when it is a sentence-transformers directory with weights, else None."""
    if not os.path.isfile(os.path.join(path, "modules.json")):
        return None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        return None
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    return SentenceTransformer(path, device=str(device)).eval()


def main(req_path: str, res_path: str) -> None:
    import torch
    import transformers

    from jaxserve.bench.hf_generate import torch_device_and_sync

    with open(req_path) as f:
        spec = json.load(f)
    device, sync = torch_device_and_sync()
    t0 = time.perf_counter()
    model = _load(spec["model"], getattr(torch, spec["dtype"]), device).eval()
    startup_s = time.perf_counter() - t0
    prompts, bs, pooling = spec["prompts"], spec["batch_size"], spec["pooling"]

    def padded(batch: list[list[int]]):
        longest = max(len(p) for p in batch)
        ids = torch.tensor([p + [0] * (longest - len(p)) for p in batch], device=device)
        mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in batch], device=device)
        return ids, mask

    def embed(batch: list[list[int]]):
        ids, mask = padded(batch)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, D]
        if pooling == "mean":
            m = mask.unsqueeze(-1).to(hidden.dtype)
            out = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        elif pooling == "cls":
            out = hidden[:, 0]
        else:
            out = hidden[torch.arange(len(batch), device=device), mask.sum(1) - 1]
        return torch.nn.functional.normalize(out, p=2, dim=1) if spec["normalize"] else out

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # sentence-transformers' order

    def timed(fn) -> float:
        with torch.inference_mode():
            fn([prompts[order[0]][:8]])  # warm-up
            sync()
            start = time.perf_counter()
            for i in range(0, len(order), bs):
                fn([prompts[j] for j in order[i : i + bs]]).cpu()
            sync()
            return time.perf_counter() - start

    elapsed = timed(embed)
    tokens = sum(len(p) for p in prompts)
    st = _sentence_transformers(spec["model"], device)
    if st is not None:
        def st_embed(batch):
            ids, mask = padded(batch)
            return st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"]

        st_s = timed(st_embed)
    result = {
        "engine": "hf-transformers-automodel+pooling",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": spec["dtype"],
        "torch_threads": torch.get_num_threads(),
        "batch_size": bs,
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "embeddings_per_s": len(prompts) / elapsed,
        "tokens_per_s": tokens / elapsed,
    }
    if st is not None:
        import sentence_transformers

        result["sentence_transformers"] = {
            "version": sentence_transformers.__version__, "elapsed_s": st_s,
            "embeddings_per_s": len(prompts) / st_s, "tokens_per_s": tokens / st_s,
        }  # fmt: skip
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""The peer baseline: HF transformers `generate` in static batches on the same requests.

Run by `jaxserve bench throughput --compare-hf` (and `bench latency`, `bench ablation`) in a subprocess, so
torch never shares a process or device memory with JAX. Needs torch (a test/bench dependency, never a
runtime one); a GGUF model goes through transformers' own GGUF loader (torch + accelerate). A config-only
directory (`jaxserve.bench.model_shapes`, jaxserve's --load-format dummy) gets random weights, initialised
on the device in the requested dtype, as jaxserve's dummy loader does.

The request file: {"model", "batch_size", "requests": [[prompt ids, output len], ...], "dtype"?}. Each batch
is padded on the left and run to its longest requested output, EOS ignored; every batch's time is recorded
(`batch_s`), so one-request batches give single-stream timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def run_in_child(module: str, spec: dict) -> dict:
    """Run ``python -m module REQUEST.json RESULT.json`` in a fresh Python process (the HF peers: torch never
    shares a process or device memory with JAX) on ``spec``; returns the result it wrote."""
    with tempfile.TemporaryDirectory() as d:
        req, res = os.path.join(d, "work.json"), os.path.join(d, "result.json")
        with open(req, "w") as f:
            json.dump(spec, f)
        subprocess.run([sys.executable, "-m", module, req, res], check=True)
        with open(res) as f:
            return json.load(f)


def run_in_subprocess(model_path: str, work, batch_size: int, dtype: str = "float32") -> dict:
    """Run this module on ``work`` (BenchRequests) in a fresh Python process; returns its result dict."""
    return run_in_child("jaxserve.bench.hf_generate", {"model": model_path, "batch_size": batch_size, "dtype": dtype,
                        "requests": [[w.prompt_token_ids, w.output_len] for w in work]})  # fmt: skip


def torch_device_and_sync():
    """(the GPU if torch sees one, else the CPU; a function that waits for the device's queued work)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _has_weights(path: str) -> bool:
    return any(f.endswith((".safetensors", ".bin", ".pt")) for f in os.listdir(path))


def load_model(path: str, dtype_name: str, device):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=dtype).to(device)
    if not _has_weights(path):
        torch.manual_seed(0)
        with torch.device(device):  # an 8B model built on the GPU directly, never in host memory
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def main(req_path: str, res_path: str) -> None:
    import torch
    import transformers

    with open(req_path) as f:
        spec = json.load(f)
    device, sync = torch_device_and_sync()
    dtype_name = spec.get("dtype", "float32")
    t0 = time.perf_counter()
    model = load_model(spec["model"], dtype_name, device)
    model.eval()
    startup_s = time.perf_counter() - t0
    reqs = spec["requests"]
    bs = spec["batch_size"]
    pad = 0

    def run_batch(batch) -> float:
        longest_in = max(len(p) for p, _ in batch)
        longest_out = max(o for _, o in batch)
        ids = torch.tensor([[pad] * (longest_in - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (longest_in - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        sync()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest_out, min_new_tokens=longest_out,
                           do_sample=False, pad_token_id=pad)
        sync()
        return time.perf_counter() - start

    run_batch([(reqs[0][0][:8], 2)])  # warm-up
    batch_s = [run_batch(reqs[i : i + bs]) for i in range(0, len(reqs), bs)]
    elapsed = sum(batch_s)
    asked = sum(o for _, o in reqs)
    result = {
        "engine": "hf-transformers-generate",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": dtype_name,
        "torch_threads": torch.get_num_threads(),
        "batch_size": bs,
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "batch_s": batch_s,
        "output_tokens": asked,
        "output_tokens_per_s": asked / elapsed,
    }
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

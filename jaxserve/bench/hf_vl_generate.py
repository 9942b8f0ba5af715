"""The peer baseline of `jaxserve bench vl`: HF transformers' Qwen2VLForConditionalGeneration.generate in static
batches on the same requests (prompt ids with one image each), in a process of its own (torch on the GPU).

    python -m jaxserve.bench.hf_vl_generate SPEC.json RESULT.json

SPEC: {"model", "dtype", "batch_sizes": [...], "workload": {...}} (jaxserve.bench.vl's workload fields). A
config-only directory (`python -m jaxserve.bench.model_shapes qwen2-vl-7b DIR`) gets random weights built on
the device. Images are preprocessed inside the timed region, as the engine does in its own. Each batch size is
timed over the whole workload and the fastest is reported ("as fast as it will go"); one that runs out of
memory is skipped and said so.
"""

from __future__ import annotations

import json
import os
import sys
import time


def load_model(path: str, dtype_name: str, device):
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    dtype = getattr(torch, dtype_name)
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        torch.manual_seed(0)
        with torch.device(device):  # built on the GPU directly, never in host memory
            return Qwen2VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device)


def main(spec_path: str, res_path: str) -> None:
    import torch
    import transformers

    from jaxserve.bench.hf_generate import torch_device_and_sync
    from jaxserve.bench.vl import make_workload
    from jaxserve.models.loader.qwen2_vl import read_qwen2_vl_config
    from jaxserve.models.qwen2_vl_image import Qwen2VLImageProcessor

    with open(spec_path) as f:
        spec = json.load(f)
    device, sync = torch_device_and_sync()
    t0 = time.perf_counter()
    model = load_model(spec["model"], spec["dtype"], device).eval()
    startup_s = time.perf_counter() - t0
    cfg = read_qwen2_vl_config(spec["model"])
    processor = Qwen2VLImageProcessor()
    work = make_workload(cfg, **spec["workload"])
    merge = cfg.vision.spatial_merge_size

    def run_batch(batch, new_tokens) -> None:
        pixels, grid = processor([img for _, img in batch])
        sizes = [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]
        rows = []
        for (ids, _), n in zip(batch, sizes):  # expand each prompt's one placeholder
            i = ids.index(cfg.image_token_id)
            rows.append(ids[:i] + [cfg.image_token_id] * n + ids[i + 1 :])
        longest = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, pixel_values=torch.from_numpy(pixels).to(device, model.dtype),
                image_grid_thw=torch.from_numpy(grid).to(device), mm_token_type_ids=(ids == cfg.image_token_id).long(),
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip

    run_batch(work[:2], 2)  # warm-up
    out_len = spec["workload"]["output_len"]
    tries = []
    for bs in spec["batch_sizes"]:
        try:
            sync()
            start = time.perf_counter()
            for i in range(0, len(work), bs):
                run_batch(work[i : i + bs], out_len)
            sync()
            tries.append({"batch_size": bs, "elapsed_s": time.perf_counter() - start})
        except torch.OutOfMemoryError:
            tries.append({"batch_size": bs, "error": "out of memory"})
            torch.cuda.empty_cache()
    done = [t for t in tries if "elapsed_s" in t]
    result = {
        "engine": "hf-transformers-generate", "transformers": transformers.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": spec["dtype"],
        "startup_s": startup_s, "tries": tries,
    }  # fmt: skip
    if done:
        best = min(done, key=lambda t: t["elapsed_s"])
        result.update(best)
        result["output_tokens"] = len(work) * out_len
        result["output_tokens_per_s"] = len(work) * out_len / best["elapsed_s"]
        result["requests_per_s"] = len(work) / best["elapsed_s"]
    else:
        result["error"] = "every batch size ran out of memory"
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

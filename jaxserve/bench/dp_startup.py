"""Data-parallel start-up: how long ``LLM(..., data_parallel_size=N)`` takes, and whether replicas > 0 read
replica 0's executables from the persistent compilation cache instead of compiling them again.

    python -m jaxserve.bench.dp_startup --dp 2 [--model DIR --load-format dummy --max-num-batched-tokens 2048]

Each run uses a fresh, empty cache folder (a cold start) unless --cache-dir names one. The replicas' stderr
(their JAX compiler debug log) is read back to count, per replica, the cache hits, the executables compiled
and written, and the misses. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections import Counter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--cache-dir", default=None, help="compilation cache folder (default: a fresh empty one)")
    ns = p.parse_args(argv)

    cache_dir = ns.cache_dir or tempfile.mkdtemp(prefix="jaxserve-dp-cache-")
    os.environ["JAX_DEBUG_LOG_MODULES"] = "jax._src.compiler,jax._src.compilation_cache"  # the replicas inherit it
    log_path = os.path.join(tempfile.mkdtemp(prefix="jaxserve-dp-log-"), "stderr.txt")
    saved_stderr = os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 2)  # the replica processes write to our fd 2
        try:
            from jaxserve import LLM

            logging.basicConfig(level=logging.INFO)  # the replicas log at this level: their ready lines
            start = time.perf_counter()
            llm = LLM(ns.model, load_format=ns.load_format, data_parallel_size=ns.dp, tensor_parallel_size=ns.tp,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
                      max_model_len=ns.max_model_len, compilation_cache_dir=cache_dir, use_tqdm_on_load=False)
            start_s = time.perf_counter() - start
            llm.llm_engine.close()
        finally:
            os.dup2(saved_stderr, 2)
    text = open(log_path, errors="replace").read()
    counts: dict[int, Counter] = {}
    patterns = {"hits": r"Persistent compilation cache hit", "written": r"Writing \S+ to persistent compilation",
                "misses": r"PERSISTENT COMPILATION CACHE MISS", "too_quick_to_cache": r"Not writing persistent"}
    for line in text.splitlines():
        m = re.search(r"\[replica (\d+)\]", line)
        if m:
            for name, pattern in patterns.items():
                if re.search(pattern, line):
                    counts.setdefault(int(m.group(1)), Counter())[name] += 1
    ready = re.findall(r"\[replica (\d+)\].*jaxserve ready: .*compiled in ([\d.]+)s", text)
    print(json.dumps({
        "dp": ns.dp, "tp": ns.tp, "model": ns.model, "start_s": round(start_s, 1), "cache_dir": cache_dir,
        "compile_s": {int(r): float(s) for r, s in ready},
        "per_replica": {r: dict(c) for r, c in sorted(counts.items())}, "log": log_path,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

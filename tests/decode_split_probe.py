"""`jaxserve bench latency` with the decode kernel's split target changed (not a test: an A/B script for a GPU).

    python tests/decode_split_probe.py PROGRAMS -- BENCH_LATENCY_ARGS...

PROGRAMS replaces ``paged_attention_pallas._TARGET_DECODE_PROGRAMS`` (512) before the engine is built: 1 gives
every decode one context split, so no merge kernel runs. Alternate it with the default in separate processes
(the same bench arguments) and compare the medians, e.g. for issue 11's single stream:

    A="--model /tmp/l8b --load-format dummy --max-model-len 1024 --repeats 3"
    for p in 512 1 512 1; do python tests/decode_split_probe.py $p -- $A --output-json split_${p}_$RANDOM.json; done
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    from jaxserve.cli import main
    from jaxserve.pallas_kernels import paged_attention_pallas

    paged_attention_pallas._TARGET_DECODE_PROGRAMS = int(sys.argv[1])
    print(f"decode_split_probe: _TARGET_DECODE_PROGRAMS = {paged_attention_pallas._TARGET_DECODE_PROGRAMS}", flush=True)
    sys.exit(main(["bench", "latency", *sys.argv[3:]]))

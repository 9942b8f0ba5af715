"""`python -m jaxserve.bench.step_profile` runs end to end on a tiny checkpoint and prints its table."""

from __future__ import annotations

import pytest
from engine_fixtures import checkpoint, run_cache_dir

from jaxserve.bench import step_profile


@pytest.mark.parametrize("extra", [[], ["--no-attention"]])
def test_step_profile_prints_a_row_per_shape(capsys, extra):
    flags = [*extra, "--model", checkpoint("llama_gqa"), "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
             "--max-num-batched-tokens", "32", "--block-size", "4", "--compilation-cache-dir", run_cache_dir()]  # fmt: skip
    assert step_profile.main(["--num-prompts", "3", "--input-len", "12", "--output-len", "3", *flags]) == 0
    out = capsys.readouterr().out
    assert ("attention: none" if extra else "attention: xla") in out
    from jaxserve.pallas_kernels import attention

    assert attention.paged_attention is not step_profile._no_attention  # restored for the rest of the process
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows and {r[2] for r in rows} <= {"prefill", "decode", "mixed"}

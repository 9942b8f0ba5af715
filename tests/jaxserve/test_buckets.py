"""Token buckets: small decode buckets on CPU only, and pick() rounding up."""

from __future__ import annotations

import pytest

from jaxserve import buckets


def test_cpu_gets_small_decode_buckets_and_gpu_does_not():
    assert buckets.token_buckets(256, "cpu") == [1, 4, 16, 32, 48, 64, 128, 256]  # 48: between 32 and 64
    assert buckets.token_buckets(2048, "gpu") == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert buckets.token_buckets(8, "cpu") == [1, 4, 8]  # a budget below 16 ends the list
    assert buckets.token_buckets(48, "cpu") == [1, 4, 16, 32, 48]  # the budget is the last bucket, once
    assert buckets.token_buckets(40, "cpu") == [1, 4, 16, 32, 40]
    assert buckets.token_buckets(100, "tpu") == [16, 32, 64, 100]


def test_a_single_decode_token_runs_unpadded_on_cpu():
    cpu = buckets.token_buckets(256, "cpu")
    assert [buckets.pick(cpu, n) for n in (1, 2, 4, 5, 17, 33, 49)] == [1, 4, 4, 16, 32, 48, 64]
    assert buckets.seq_bucket_for(1, 64) == 1
    with pytest.raises(ValueError, match="exceeds the largest bucket 256"):
        buckets.pick(cpu, 257)

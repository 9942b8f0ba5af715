"""The pooling scheduler (device-free): whole prompts, arrival order, within the token and sequence limits."""

from __future__ import annotations

import pytest

from jaxserve.pooling_params import PoolingParams
from jaxserve.pooling_scheduler import PoolingRequest, PoolingScheduler


def _req(rid: str, n: int) -> PoolingRequest:
    return PoolingRequest(rid, list(range(n)), PoolingParams(), 0.0)


def test_batches_in_arrival_order_within_the_budget():
    s = PoolingScheduler(max_num_seqs=3, max_num_batched_tokens=100)
    for rid, n in [("a", 40), ("b", 50), ("c", 20), ("d", 5), ("e", 5), ("f", 5)]:
        s.add_request(_req(rid, n))
    assert [r.request_id for r in s.schedule()] == ["a", "b"]  # c would pass 100 tokens: it waits, in order
    assert [r.request_id for r in s.schedule()] == ["c", "d", "e"]  # three sequences at most
    s.abort(["f", "unknown"])
    assert s.schedule() == [] and not s.has_unfinished_requests()


def test_a_prompt_over_the_budget_is_refused():
    s = PoolingScheduler(max_num_seqs=4, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="17 tokens exceeds max_num_batched_tokens=16"):
        s.add_request(_req("a", 17))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens=0 is invalid"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens=-2 is invalid"),
    (dict(dimensions=0), "dimensions=0 is invalid"),
])  # fmt: skip
def test_pooling_params_name_the_bad_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        PoolingParams(**kwargs)


def test_pooling_limits_keep_a_whole_prompt_in_one_step():
    from jaxserve.config import EngineArgs
    from jaxserve.pooling_engine import pooling_limits

    def limits(st_max=None, model_max=512, platform="cpu", **kw):
        return pooling_limits(EngineArgs(**kw), model_max, st_max, platform)

    assert limits(st_max=256) == (256, 256, 64)  # all-MiniLM-L6-v2 on CPU
    assert limits(model_max=40960, platform="gpu") == (8192, 8192, 256)  # Qwen3-Embedding: capped
    assert limits(model_max=40960, platform="gpu", max_num_batched_tokens=2048) == (2048, 2048, 256)
    assert limits(max_model_len=512, max_num_seqs=8) == (512, 512, 8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=128 is smaller than max_model_len=512"):
        limits(max_model_len=512, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the 512 positions the model takes"):
        limits(max_model_len=1024)

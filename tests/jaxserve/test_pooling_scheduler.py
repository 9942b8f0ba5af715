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
    assert [(r.request_id, at) for r, at in s.schedule()] == [("a", 0), ("b", 40)]  # c would pass 100: it waits
    assert [(r.request_id, at) for r, at in s.schedule()] == [("c", 0), ("d", 20), ("e", 25)]  # 3 sequences at most
    s.abort(["f", "unknown"])
    assert s.schedule() == [] and not s.has_unfinished_requests()


def test_first_fit_into_rows():
    s = PoolingScheduler(max_num_seqs=16, max_num_batched_tokens=64, row_len=16)
    for rid, n in [("a", 10), ("b", 10), ("c", 6), ("d", 16), ("e", 3), ("f", 16), ("g", 1), ("h", 4), ("i", 1)]:
        s.add_request(_req(rid, n))
    # a: row 0; b: row 1; c fills row 0; d: row 2; e: row 1 after b; f: row 3; g: row 1; h would need a fifth
    # row: the step ends there (i waits behind it: arrival order)
    assert [(r.request_id, at) for r, at in s.schedule()] == [
        ("a", 0), ("b", 16), ("c", 10), ("d", 32), ("e", 26), ("f", 48), ("g", 29)
    ]  # fmt: skip
    assert [(r.request_id, at) for r, at in s.schedule()] == [("h", 0), ("i", 4)]
    with pytest.raises(ValueError, match="17 tokens exceeds max_num_batched_tokens=64 \\(rows of 16\\)"):
        s.add_request(_req("h", 17))


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

    assert limits(st_max=256) == (256, 256, 64, 256)  # all-MiniLM-L6-v2 on CPU: one row
    assert limits(st_max=256, max_num_batched_tokens=1000) == (256, 768, 64, 256)  # three rows of 256
    assert limits(platform="gpu") == (512, 2048, 256, 512)  # BERT-base on a GPU: four rows of 512
    assert limits(model_max=40960, platform="gpu") == (8192, 8192, 256, 8192)  # Qwen3-Embedding: capped
    assert limits(model_max=40960, platform="gpu", max_num_batched_tokens=2048) == (2048, 2048, 256, 2048)
    assert limits(max_model_len=300, max_num_batched_tokens=300, max_num_seqs=8) == (300, 300, 8, 300)
    assert limits(max_model_len=300, max_num_batched_tokens=2000) == (300, 1536, 64, 512)
    with pytest.raises(ValueError, match="max_num_batched_tokens=128 is smaller than max_model_len=512"):
        limits(max_model_len=512, max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="max_model_len=1024 exceeds the 512 positions the model takes"):
        limits(max_model_len=1024)

"""KVCacheManager: ref counts, chained hashes, LRU eviction, prefix hits and revival, failed allocation."""

import pytest

import jaxserve.block_hash as block_hash
from jaxserve.block_hash import extend_block_hashes, hash_block_tokens
from jaxserve.block_manager import NULL_BLOCK_ID, KVCacheManager
from jaxserve.request import Request
from jaxserve.sampling_params import SamplingParams

BS = 4


def make_req(req_id, tokens):
    return Request(req_id, list(tokens), SamplingParams())


def compute(kv, req, num_tokens=None):
    """Admit (with prefix hits) and pretend the runner computed ``num_tokens`` (default: all)."""
    blocks, num_cached = kv.get_computed_blocks(req)
    num_new = (req.num_tokens if num_tokens is None else num_tokens) - num_cached
    assert kv.allocate_slots(req, num_new, blocks)
    req.num_computed_tokens = num_cached + num_new
    kv.cache_full_blocks(req)
    return num_cached


def state(kv):
    return (
        [b.block_id for b in kv.free_queue],
        {h: b.block_id for h, b in kv.cached.items()},
        [b.ref_cnt for b in kv.blocks],
        {k: list(v) for k, v in kv._req_block_ids.items()},
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
    )


def test_hash_chaining():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))  # content only, not the container
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    # The same tokens under a different parent are a different prefix.
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    req = make_req("r", range(1, 11))  # 10 tokens: 2 full blocks of 4
    hashes = extend_block_hashes(req, BS, 99)
    assert hashes == [a, hash_block_tokens(a, [5, 6, 7, 8])]
    assert req.block_hashes is hashes
    req.append_output_token(11)
    req.append_output_token(12)  # the third block is full now; only it is hashed
    assert extend_block_hashes(req, BS, 99)[2] == hash_block_tokens(hashes[1], [9, 10, 11, 12])


def test_null_block_never_allocated_and_usage():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0 and kv.max_num_tokens == 16
    req = make_req("a", range(16))
    compute(kv, req)
    assert NULL_BLOCK_ID not in kv.get_block_ids(req)
    assert kv.usage == 1.0 and kv.num_free_blocks == 0
    kv.free(req)
    assert kv.usage == 0.0


def test_allocate_grows_only_when_a_block_fills():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    req = make_req("a", range(5))
    assert kv.allocate_slots(req, 5)
    assert len(kv.get_block_ids(req)) == 2
    req.num_computed_tokens = 5
    for _ in range(3):  # decode steps filling block 2
        req.append_output_token(0)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(kv.get_block_ids(req)) == 2
    req.append_output_token(0)
    assert kv.allocate_slots(req, 1)
    assert len(kv.get_block_ids(req)) == 3


def test_prefix_hit_shares_blocks_and_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert compute(kv, a) == 0
    assert len(kv.cached) == 2
    b = make_req("b", list(range(8)) + [50, 51, 52])
    assert compute(kv, b) == 8
    a_ids, b_ids = kv.get_block_ids(a), kv.get_block_ids(b)
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert [kv.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    kv.free(a)
    # Shared blocks stay owned by b; only a's private block is free.
    assert [kv.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    assert [blk.block_id for blk in kv.free_queue].count(a_ids[0]) == 0
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.blocks)
    assert kv.num_free_blocks == 9


def test_last_token_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    compute(kv, make_req("a", range(12)))  # 3 full blocks cached
    blocks, n = kv.get_computed_blocks(make_req("b", range(12)))
    assert n == 8 and len(blocks) == 2  # the third block holds the last token, whose logits are needed
    blocks, n = kv.get_computed_blocks(make_req("c", range(13)))
    assert n == 12


def test_revival_after_free_and_eviction_drops_hash():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = make_req("a", range(9))
    compute(kv, a)
    a_ids = list(kv.get_block_ids(a))
    kv.free(a)
    assert kv.usage == 0.0 and len(kv.cached) == 2  # freed, but still cached
    b = make_req("b", range(9))
    assert compute(kv, b) == 8
    assert kv.get_block_ids(b)[:2] == a_ids[:2]  # revived out of the free queue
    assert kv.num_free_blocks == 4 - 3
    kv.free(b)
    # Fill the whole cache with unrelated tokens: the cached blocks are evicted and their hashes dropped.
    c = make_req("c", range(100, 116))
    compute(kv, c, num_tokens=1)  # takes a blank block; the cached ones are evicted last
    assert len(kv.cached) == 2
    assert kv.allocate_slots(c, 15)
    assert kv.cached == {}
    kv.free(c)
    assert kv.get_computed_blocks(make_req("d", range(9))) == ([], 0)


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=9, block_size=BS)  # 8 usable
    a, b = make_req("a", range(8)), make_req("b", range(100, 108))  # 2 blocks each
    u = make_req("u", range(200, 203))  # one partial block: never hashed
    for r in (a, b, u):
        compute(kv, r)
    a_ids, b_ids, u_ids = (list(kv.get_block_ids(r)) for r in (a, b, u))
    kv.free(a)
    kv.free(b)
    kv.free(u)
    order = [blk.block_id for blk in kv.free_queue]
    # Unhashed blocks first (nothing can revive them), then never-used ones in id order, then cached
    # blocks oldest freed first, each request's tail block before its head.
    assert order[0] == u_ids[0]
    assert order[-4:] == [a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    # Taking the 4 uncached blocks + 1 more evicts a's tail: a's head block stays cached.
    x = make_req("x", range(300, 320))
    assert kv.allocate_slots(x, 20)
    assert a_ids[1] in kv.get_block_ids(x)
    blocks, n = kv.get_computed_blocks(make_req("a2", range(9)))
    assert n == 4 and blocks[0].block_id == a_ids[0]
    blocks, n = kv.get_computed_blocks(make_req("b2", range(100, 109)))
    assert n == 8


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=BS)  # 5 usable
    a = make_req("a", range(9))
    compute(kv, a)
    kv.free(a)  # 2 cached free blocks + 3 blank
    b = make_req("b", range(100, 112))
    compute(kv, b, num_tokens=4)
    before = state(kv)
    c = make_req("c", list(range(8)) + list(range(500, 520)))  # hits a's 2 blocks, needs 5 more
    blocks, n = kv.get_computed_blocks(c)
    assert n == 8
    assert not kv.allocate_slots(c, c.num_tokens - n, blocks)
    assert state(kv) == before
    assert not kv.allocate_slots(b, 100)  # a running request growing too far
    assert state(kv) == before
    assert kv.allocate_slots(b, 8)


def test_hash_collision_never_reuses_wrong_kv(monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda parent, tokens: 42)
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    compute(kv, make_req("a", range(9)))
    assert kv.get_computed_blocks(make_req("b", range(50, 59))) == ([], 0)
    # Same first block, different second: the second's colliding hash is refused by its tokens.
    blocks, n = kv.get_computed_blocks(make_req("c", [0, 1, 2, 3, 9, 9, 9, 9, 9]))
    assert n == 4


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_req("a", range(9))
    compute(kv, a)
    b = make_req("b", range(20, 29))
    compute(kv, b)
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.cached == {} and all(blk.block_hash is None for blk in kv.blocks)
    assert kv.get_computed_blocks(make_req("a2", range(9))) == ([], 0)
    assert kv.get_computed_blocks(make_req("b2", range(20, 29))) == ([], 0)
    # b keeps its blocks and can go on; freeing it puts blank blocks back.
    kv.free(b)
    assert kv.num_free_blocks == 9


def test_duplicate_prefix_computed_twice_stays_private():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = make_req("a", range(9)), make_req("b", range(9))
    assert kv.allocate_slots(a, 9) and kv.allocate_slots(b, 9)  # both admitted before either computed
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_full_blocks(r)
    assert len(kv.cached) == 2
    assert all(kv.blocks[i].block_hash is None for i in kv.get_block_ids(b))
    kv.free(a)
    kv.free(b)
    assert sum(blk.ref_cnt for blk in kv.blocks) == 0 and kv.num_free_blocks == 9


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    compute(kv, make_req("a", range(9)))
    assert kv.cached == {}
    assert kv.get_computed_blocks(make_req("b", range(9))) == ([], 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_too_few_blocks_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=1, block_size=BS)

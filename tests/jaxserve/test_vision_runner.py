"""The encoder cache's bookkeeping and a step's mm_fields, host side only (the vision step itself is stubbed):
pool rows per token across a chunk boundary, M-RoPE rows before and after the prompt, eviction order (idle
images first, in LRU order; never one the step reads), and the error when one step's images do not fit."""

from __future__ import annotations

import collections
import dataclasses
import types

import numpy as np
import pytest

from jaxserve.multimodal import ImageItem, MultiModalInputs, _runs, parse_limit_mm_per_prompt
from jaxserve.vision_runner import VisionRunner, patch_bucket, pool_rows


def _runner(num_rows: int, eager: bool = False) -> VisionRunner:
    v = object.__new__(VisionRunner)
    v.runner = types.SimpleNamespace(_eager_model=object() if eager else None)
    v.num_rows, v.entries, v.free_rows = num_rows, collections.OrderedDict(), list(range(num_rows - 1, -1, -1))
    v._pinned, v._misses, v.num_encoded, v.num_cache_hits = set(), [], 0, 0
    v.encoded, v.calls = [], []

    def encode_batch(bucket, items):  # no device: record each vision call's (patch bucket, images)
        v.encoded.extend(img.hash for img, _ in items)
        v.calls.append((bucket, len(items)))

    v._encode_batch = encode_batch
    return v


def _img(name: str, offset: int, n: int) -> ImageItem:
    return ImageItem(name.encode() * 32, np.zeros((4 * n, 8), np.float32), (1, 2, 2 * n), offset, n)


@dataclasses.dataclass
class _Seq:
    req_id: str
    token_ids: list
    start_pos: int
    mm: object


def test_fields_across_a_chunk_boundary_and_past_the_prompt():
    img = _img("a", 2, 4)  # prompt of 8 tokens: text 0-1, image 2-5, text 6-7
    rope = np.stack([np.arange(8), np.arange(8) + 10, np.arange(8) + 20]).astype(np.int32)
    mm = MultiModalInputs((img,), rope, mrope_delta=-3)
    v = _runner(16)
    # Step 1: tokens 0-3 of the request (the chunk ends inside the image), after a 2-token text request.
    pos = np.array([0, 1, 0, 1, 2, 3, 0, 0], np.int32)
    f1 = v.step_fields([_Seq("t", [5, 6], 0, None), _Seq("r", [0] * 4, 0, mm)], pos, np.array([0, 2, 6]))
    rows = v.entries[img.hash].rows
    assert f1[3].tolist() == [-1, -1, -1, -1, rows[0], rows[1], -1, -1]
    assert f1[:3, 2:6].tolist() == rope[:, :4].tolist() and f1[:3, :2].tolist() == [[0, 1]] * 3
    assert v.entries[img.hash].holders == {"r"}  # still has image tokens to compute
    # Step 2: tokens 4-7 (the rest of the image), then a decode at position 8: 8 + delta on all rows.
    f2 = v.step_fields([_Seq("r", [0] * 4, 4, mm)], np.array([4, 5, 6, 7], np.int32), np.array([0, 4]))
    assert f2[3].tolist() == [rows[2], rows[3], -1, -1] and v.encoded == [img.hash]  # encoded once
    assert not v.entries[img.hash].holders
    f3 = v.step_fields([_Seq("r", [0], 8, mm)], np.array([8], np.int32), np.array([0, 1]))
    assert f3[:, 0].tolist() == [5, 5, 5, -1]


def test_mixed_step_rows_equal_each_requests_own():
    """Decodes of vision-language requests (p + delta, vectorized), text requests (p), a prompt chunk and
    padding tokens in one step: each token's rows are its request's ``rope_rows`` (text: p)."""
    rope = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    mms = [MultiModalInputs((_img(f"{k}", 2, 4),), rope + k, mrope_delta=k - 5) for k in range(3)]
    seqs = [_Seq("d0", [0], 9, mms[0]), _Seq("t", [0, 0], 3, None), _Seq("d2", [0, 0, 0], 8, mms[2]),
            _Seq("p1", [0] * 5, 0, mms[1]), _Seq("d1", [0], 12, mms[1])]  # fmt: skip
    qsl = np.cumsum([0] + [len(q.token_ids) for q in seqs] + [0, 0]).astype(np.int32)  # two padding sequences
    pos = np.concatenate([q.start_pos + np.arange(len(q.token_ids)) for q in seqs] + [[0, 0]]).astype(np.int32)
    fields = _runner(16).step_fields(seqs, pos, qsl)
    want = np.concatenate([q.mm.rope_rows(pos[a:b]) if q.mm else np.stack([pos[a:b]] * 3)
                           for q, a, b in zip(seqs, qsl, qsl[1:])] + [np.zeros((3, 2), np.int32)], axis=1)  # fmt: skip
    assert fields[:3].tolist() == want.tolist()
    assert (fields[3, 8:11] >= 0).all() and (np.delete(fields[3], [8, 9, 10]) == -1).all()  # p1's image: its 2-4


def test_eviction_prefers_idle_lru_and_never_the_steps_own():
    v = _runner(8)
    a, b, c = _img("a", 0, 4), _img("b", 0, 4), _img("c", 0, 4)
    v._lookup(a)
    v._lookup(b)
    v.entries[a.hash].holders.add("r1")  # a is still wanted; b is idle
    v._pinned = set()
    v._lookup(c)
    assert list(v.entries) == [a.hash, c.hash]  # b went, though a is older
    v._pinned = set()
    v.entries[c.hash].holders.add("r2")
    v._lookup(b)  # nothing idle: the least recent wanted one (a) goes; it would be encoded again on need
    assert list(v.entries) == [c.hash, b.hash]
    v._lookup(c)  # a hit, in the same step as b
    with pytest.raises(RuntimeError, match="encoder cache"):
        v._lookup(_img("d", 0, 4))  # c and b are both read by this step
    assert v.num_cache_hits == 1 and [i.hash for i, _ in v._misses] == [a.hash, b.hash, c.hash, b.hash]


def test_a_steps_misses_are_encoded_together_by_bucket():
    """Misses go in one call per patch bucket (the step's reads of them are hits); a step whose images do
    not fit the pool raises and leaves no entry whose rows were never written."""
    v = _runner(64)
    rope = np.zeros((3, 40), np.int32)
    small = [_img(n, 4 * k, 4) for k, n in enumerate("abc")]  # 16 patch rows each: the 64-row bucket
    big = _img("d", 12, 20)  # 80 patch rows: the 128-row bucket
    seqs = [_Seq("r1", [0] * 40, 0, MultiModalInputs((small[0], small[1], big), rope, 0)),
            _Seq("r2", [0] * 40, 0, MultiModalInputs((small[2], _img("a", 0, 4)), rope, 0))]  # fmt: skip
    v.step_fields(seqs, np.zeros(80, np.int32), np.array([0, 40, 80]))
    assert sorted(v.calls) == [(64, 3), (128, 1)] and v.num_cache_hits == 1  # "a" twice: one miss, one hit
    v.calls.clear()
    huge = [_img(n, 0, 40) for n in "xy"]  # 80 rows for 64: more than the pool
    seqs = [_Seq(f"s{k}", [0] * 40, 0, MultiModalInputs((img,), rope, 0)) for k, img in enumerate(huge)]
    with pytest.raises(RuntimeError, match="encoder cache"):
        v.step_fields(seqs, np.zeros(80, np.int32), np.array([0, 40, 80]))
    assert not v.calls and huge[0].hash not in v.entries and len(v.free_rows) + sum(
        len(e.rows) for e in v.entries.values()) == 64  # fmt: skip


def test_eager_encodes_one_image_a_call():
    """enforce_eager has no program memory plan: batched [B, Hv, N, N] scores ran a 7B model out of memory."""
    v = _runner(64, eager=True)
    rope = np.zeros((3, 40), np.int32)
    seqs = [_Seq("r1", [0] * 40, 0, MultiModalInputs(tuple(_img(n, 4 * k, 4) for k, n in enumerate("abc")), rope, 0))]
    v.step_fields(seqs, np.zeros(40, np.int32), np.array([0, 40]))
    assert v.calls == [(64, 1)] * 3


def test_small_helpers():
    assert [patch_bucket(n) for n in (4, 64, 65, 1024)] == [64, 64, 128, 1024]
    assert pool_rows(2048, 16384) == 32768 and pool_rows(16, 4) == 1024
    assert _runs([1, 7, 7, 2, 7], 7) == [(1, 2), (4, 1)]
    assert parse_limit_mm_per_prompt("image=3") == {"image": 3} == parse_limit_mm_per_prompt('{"image": 3}')
    with pytest.raises(ValueError, match="only 'image'"):
        parse_limit_mm_per_prompt("video=1")

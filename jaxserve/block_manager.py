"""Paged KV cache bookkeeping: which physical blocks each request owns, and the prefix cache.

Host-side only (no arrays): the model runner sees block ids through ``ScheduledSeq.block_ids``, never
the ``Block`` objects here. The scheduler talks to this module only through ``KVCacheManager``.

Life of a block: free (in the LRU free queue) -> owned by one or more requests (ref_cnt > 0) -> once
all its slots hold computed KV, it gets a chained hash and enters the prefix-cache table -> when the
last owner lets go it goes back to the free queue *keeping its hash*, so a later request with the same
prefix can revive it -> it loses its hash only when it is evicted, i.e. taken from the queue for reuse.
"""

from __future__ import annotations

import collections
from typing import Iterator, Optional

from jaxserve.block_hash import extend_block_hashes
from jaxserve.request import Request

# Block 0 is never handed to a request: it is the padding id for block tables, and any kernel that
# writes padding tokens through a padded table entry scribbles on it harmlessly.
NULL_BLOCK_ID = 0


class Block:
    """One physical KV block of ``block_size`` token slots."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests whose block table holds this block
        # Set only while the block is in the prefix-cache table (full and computed), else None.
        self.block_hash: Optional[int] = None
        # What the hash stands for, kept to verify hits: a hash match alone never reuses a block.
        self.parent_hash: Optional[int] = None
        self.token_ids: Optional[tuple[int, ...]] = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash & 0xFFFF:04x}"
        return f"Block({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Blocks with ref_cnt 0, least recently freed first: the front is evicted first.

    An ordered dict gives O(1) append, pop from the front, and removal from the middle (a cached block
    revived by a prefix hit leaves the queue wherever it is).
    """

    def __init__(self, blocks: list[Block]) -> None:
        self._q: collections.OrderedDict[int, Block] = collections.OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._q.values())

    def append(self, block: Block) -> None:
        self._q[block.block_id] = block

    def append_front(self, block: Block) -> None:
        self._q[block.block_id] = block
        self._q.move_to_end(block.block_id, last=False)

    def popleft(self) -> Block:
        return self._q.popitem(last=False)[1]

    def remove(self, block: Block) -> None:
        del self._q[block.block_id]


class KVCacheManager:
    """Allocates KV blocks to requests, with reference counts and automatic prefix caching.

    ``num_blocks`` includes the reserved null block 0, so ``num_blocks - 1`` blocks are usable. All
    methods are O(blocks touched); none copies a request's token list. Not thread safe: call it from the
    engine thread only.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is too small: need at least 2 (block 0 is reserved)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK_ID + 1 :])
        self.cached: dict[int, Block] = {}  # block hash -> the block holding that prefix's KV
        self._req_blocks: dict[str, list[Block]] = {}
        # Block ids kept alongside the blocks, so the scheduler can hand out a table without building it.
        self._req_block_ids: dict[str, list[int]] = {}
        self._req_num_cached: dict[str, int] = {}  # leading blocks of the request already hashed
        # Prometheus-style counters (tokens), counted once per admission, not per retry.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- capacity ----

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take, cached-but-unused ones included (they are evictable)."""
        return len(self.free_queue)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one request can ever hold: the whole cache."""
        return self.num_usable_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of usable blocks owned by some request (cached free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_usable_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks matching the request's tokens, and the tokens they cover.

        Read only: nothing is claimed until ``allocate_slots(..., computed_blocks=blocks)``. At least the
        request's last token is left out, since the runner must compute it to get logits for sampling.
        """
        if not self.enable_prefix_caching or request.request_id in self._req_blocks:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = extend_block_hashes(request, bs, max_blocks)
        tokens = request.all_token_ids
        found: list[Block] = []
        parent: Optional[int] = None
        for i in range(max_blocks):
            block = self.cached.get(hashes[i])
            if (
                block is None
                or block.parent_hash != parent
                or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break
            found.append(block)
            parent = hashes[i]
        return found, len(found) * bs

    def cache_full_blocks(self, request: Request) -> None:
        """Hash and publish the request's blocks that became full of computed KV since the last call.

        Call after ``request.num_computed_tokens`` has advanced. A block whose prefix is already cached
        in another block (two requests computed the same prefix at once) stays private and unhashed.
        """
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        start = self._req_num_cached.get(req_id)  # None: it holds no blocks
        if start is None:
            return
        # Only tokens known on the host can be hashed: a step in flight may have computed (or be
        # computing) KV for a token the host has not read back yet. Its KV lands before any later step
        # can read the block, since steps run in order on the device.
        known = min(request.num_computed_tokens, len(request.all_token_ids))
        if known // self.block_size <= start:
            return  # no block filled up since the last call: most decode steps, so decided before anything else
        blocks = self._req_blocks[req_id]
        end = min(known // self.block_size, len(blocks))
        if end <= start:
            return
        bs = self.block_size
        hashes = extend_block_hashes(request, bs, end)
        tokens = request.all_token_ids
        for i in range(start, end):
            block = blocks[i]
            h = hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.parent_hash = hashes[i - 1] if i > 0 else None
                block.token_ids = tuple(tokens[i * bs : (i + 1) * bs])
                self.cached[h] = block
        self._req_num_cached[req_id] = end

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights are loaded). Blocks in use stay allocated
        but are no longer shared with new requests. Always succeeds; returns True."""
        for block in self.cached.values():
            self._drop_hash(block)
        self.cached.clear()
        return True

    # ---- allocation ----

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Optional[list[Block]] = None
    ) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``computed_blocks`` (from ``get_computed_blocks``, admission only) are shared rather than
        allocated, and their tokens count as computed: the caller moves ``request.num_computed_tokens``
        past them. Returns False, changing nothing, when there are not enough free blocks.
        """
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks is not None and not computed_blocks:
            # The common decode step, decided first: the blocks held already have room.
            if request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
                return True
        computed_blocks = computed_blocks or []
        admitting = blocks is None
        if not admitting and computed_blocks:
            raise ValueError(f"request {req_id!r} already holds blocks; computed_blocks are for admission only")
        num_held = 0 if admitting else len(blocks)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - num_held - len(computed_blocks)
        if num_needed <= 0 and not admitting:
            return True  # the common decode step: the last block still has room
        # Reviving a cached block takes it out of the free queue too, so it costs capacity.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + num_revived > len(self.free_queue):
            return False

        if admitting:
            blocks = self._req_blocks[req_id] = []
            self._req_block_ids[req_id] = []
            self._req_num_cached[req_id] = len(computed_blocks)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * self.block_size
        block_ids = self._req_block_ids[req_id]
        # Claim the hits before popping new blocks, so that eviction cannot take a block being reused.
        for block in computed_blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            blocks.append(block)
            block_ids.append(block.block_id)
        for _ in range(num_needed):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: this prefix is no longer cached
                del self.cached[block.block_hash]
                self._drop_hash(block)
            block.ref_cnt = 1
            blocks.append(block)
            block_ids.append(block.block_id)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (no-op if it holds none). Shared blocks stay until their last owner
        lets go. Cached blocks join the back of the queue, tail blocks first: a prefix's later blocks are
        less likely to be shared than its head, so they should be evicted first. Unhashed blocks go to the
        front, since nothing can revive them."""
        req_id = request.request_id
        blocks = self._req_blocks.pop(req_id, None)
        self._req_block_ids.pop(req_id, None)
        self._req_num_cached.pop(req_id, None)
        if blocks is None:
            return
        for block in reversed(blocks):
            self._release(block)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past the first ``num_tokens`` slots: after a verify step, the slots of
        rejected proposals. Such blocks hold no computed token, so they are never hashed; they go to the front."""
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks is None:
            return
        keep = max(self.num_blocks_for(num_tokens), self._req_num_cached[req_id])
        block_ids = self._req_block_ids[req_id]
        while len(blocks) > keep:
            block_ids.pop()
            self._release(blocks.pop())

    def _release(self, block) -> None:
        """Drop one reference; an unreferenced block goes to the free queue: unhashed ones to the front (nothing
        can revive them), hashed ones to the back, so their cached prefix stays findable the longest."""
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self.free_queue.append_front(block)
            else:
                self.free_queue.append(block)

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table. The manager's own list: read only, and valid until the next
        allocate/free of this request (it grows in place as the request does)."""
        return self._req_block_ids.get(request.request_id, [])

    def num_held_blocks(self, request: Request) -> int:
        return len(self._req_blocks.get(request.request_id, ()))

    @staticmethod
    def _drop_hash(block: Block) -> None:
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None

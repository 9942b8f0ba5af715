"""Chained content hashes of full KV blocks, the keys of the prefix cache.

Block i's hash covers block i's tokens and, through its parent's hash, every token before them, so
equal hashes mean equal whole prefixes. SHA-256 rather than Python's ``hash``: prompts come from users,
and a crafted collision of a fast non-cryptographic hash would let one user's request read another's
KV. The block manager also keeps each cached block's tokens and parent hash and compares them on every
hit, so a collision would also have to match the block's own tokens exactly.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

from jaxserve.request import Request

# The parent of a sequence's first block. Not a possible SHA-256 output in practice.
ROOT_PARENT_BYTES = b"\x00" * 32


def hash_block_tokens(parent_hash: Optional[int], token_ids: Sequence[int]) -> int:
    """The chained hash of one full block: SHA-256 of (parent hash, token ids), as an int."""
    h = hashlib.sha256(ROOT_PARENT_BYTES if parent_hash is None else parent_hash.to_bytes(32, "little"))
    # int64 rather than int32: vocabularies are far smaller, but a bad id must raise, not wrap around.
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def extend_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[int]:
    """Make ``request.block_hashes`` cover its first ``num_blocks`` full blocks, hashing only new ones.

    Hashes depend only on token content (and the request's LoRA adapter), so they stay valid across preemption and are computed once per
    block over the request's life. Returns the request's own list (read only).
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_blocks = min(num_blocks, len(tokens) // block_size)
    # A LoRA request's chain starts from its adapter's salt: its KV differs from the base model's and from
    # any other adapter's for the same tokens, so no block is shared across adapters.
    lora = request.lora_request
    parent = hashes[-1] if hashes else (lora.cache_salt if lora is not None else None)
    for i in range(len(hashes), num_blocks):
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes

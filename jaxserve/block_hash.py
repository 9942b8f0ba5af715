"""Chained content hashes of full KV blocks, the keys of the prefix cache.

Block i's hash covers block i's tokens and, through its parent's hash, every token before them, so
equal hashes mean equal whole prefixes. SHA-256 rather than Python's ``hash``: prompts come from users,
and a crafted collision of a fast non-cryptographic hash would let one user's request read another's
KV. The block manager also keeps each cached block's tokens and parent hash and compares them on every
hit, so a collision would also have to match the block's own tokens exactly.

Images: a block holding any of an image's placeholder tokens (identical ids whatever the picture) also
hashes that image's content hash and first-token offset, so two prompts with the same text and different
images never share that block or any after it; the same image does.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

from jaxserve.request import Request

# The parent of a sequence's first block. Not a possible SHA-256 output in practice.
ROOT_PARENT_BYTES = b"\x00" * 32


def hash_block_tokens(parent_hash: Optional[int], token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The chained hash of one full block: SHA-256 of (parent hash, token ids, extra keys), as an int."""
    h = hashlib.sha256(ROOT_PARENT_BYTES if parent_hash is None else parent_hash.to_bytes(32, "little"))
    # int64 rather than int32: vocabularies are far smaller, but a bad id must raise, not wrap around.
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def image_keys(request: Request, lo: int, hi: int) -> bytes:
    """The content hash and offset of every image with placeholder tokens in [lo, hi); b"" for text."""
    mm = getattr(request, "mm", None)
    if mm is None:
        return b""
    return b"".join(
        img.hash + img.offset.to_bytes(8, "little")
        for img in mm.images
        if img.offset < hi and img.offset + img.num_tokens > lo
    )


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
        lo, hi = i * block_size, (i + 1) * block_size
        extra = image_keys(request, lo, hi)
        parent = hash_block_tokens(parent, tokens[lo:hi], extra) if extra else hash_block_tokens(parent, tokens[lo:hi])
        hashes.append(parent)
    return hashes
